"""The local target's numbers: the gate before any traffic moves and canary steps through the gateway,
with a rollback at every step. Each deploy here measures with short windows (gate 0.5 s, windows
0.3 s); everything binds 127.0.0.1 and every process started is stopped by pid (``stop_gateway``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from tests.support.serving import assets, gate_metric, http_call, predict_url, smoke_data  # noqa: F401 (fixture)

from hybridflow.config import ServingSettings
from hybridflow.errors import DeploymentError
from hybridflow.serving.deploy import deploy, stop_gateway
from hybridflow.serving.processes import alive
from hybridflow.serving.router import NoBackend, pick_backend

LENIENT = {"p99_ms": 10_000, "min_rps": 1, "max_error_rate": 0.0, "max_p99_regression": 1000, "concurrency": 2,
           "duration_s": 0.5}
STEPS = {"steps": [10, 50, 100], "window_s": 0.3, "concurrency": 4}


def _settings(port: int, gate: dict | None = None, steps: list[int] | None = None) -> ServingSettings:
    return ServingSettings.model_validate({"port": port, "gate": {**LENIENT, **(gate or {})},
                                           "canary": {**STEPS, **({"steps": steps} if steps else {})}})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _active(state_root: Path) -> dict:
    return json.loads((state_root / "digits" / "active.json").read_text())


def test_the_gateway_sends_the_canary_its_percent_of_requests(tmp_path):
    edir = tmp_path / "digits"
    edir.mkdir()
    stable = {"version": "v1", "url": "http://127.0.0.1:9001"}
    (edir / "active.json").write_text(json.dumps({**stable, "canary": {"version": "v2", "url": "http://127.0.0.1:9002",
                                                                       "percent": 30}}))
    assert pick_backend(edir, draw=29.9)["version"] == "v2" and pick_backend(edir, draw=30.0)["version"] == "v1"
    drawn = [pick_backend(edir)["version"] for _ in range(2000)]
    assert 0.25 < drawn.count("v2") / len(drawn) < 0.35  # drawn per request, weighted
    (edir / "active.json").write_text(json.dumps({**stable, "canary": {"version": "v2", "url": "http://10.0.0.2:80",
                                                                       "percent": 100}}))
    with pytest.raises(NoBackend, match="127.0.0.1"):  # a canary is held to loopback like the stable backend
        pick_backend(edir)
    (edir / "active.json").write_text(json.dumps(stable))
    assert {pick_backend(edir)["version"] for _ in range(50)} == {"v1"}


@pytest.fixture(scope="module")
def served(assets, tmp_path_factory):  # noqa: F811
    """digits v1 serving behind its own gateway; everything under the state root stopped after."""
    state_root = tmp_path_factory.mktemp("canary") / "state"
    port = _free_port()
    yield state_root, port
    pids = [json.loads(p.read_text())["pid"] for p in [state_root / "router.json",
                                                       *state_root.glob("*/versions/*.json")] if p.is_file()]
    stop_gateway(state_root)
    assert not any(alive(pid) for pid in pids)


def _deploy(assets, served, version: str, settings: ServingSettings, log=None) -> dict:  # noqa: F811
    state_root, port = served
    return deploy(assets["digits"][version], version, state_root=state_root, endpoint="digits", port=port,
                  smoke=smoke_data(assets, "digits"), metric=gate_metric("digits"), log=log, serving=settings)


@pytest.fixture
def v1_serving(assets, served):  # noqa: F811
    state_root, port = served
    if not (state_root / "digits" / "active.json").is_file() or _active(state_root)["version"] != "v1":
        _deploy(assets, served, "v1", _settings(port, steps=[100]))
    return _active(state_root)


class _Client:
    """Single-row requests through the gateway while a deploy runs; what answered each one."""

    def __init__(self, port: int, row: list) -> None:
        self.url, self.row, self.seen = predict_url(f"http://127.0.0.1:{port}", "digits"), row, []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self.done.is_set() and len(self.seen) < 5000:
            try:
                status, body, headers = http_call("POST", self.url, {"instances": [self.row]})
                self.seen.append((status, headers.get("X-Model-Version")))
            except OSError as exc:
                self.seen.append((0, str(exc)))
            time.sleep(0.01)

    def __enter__(self) -> _Client:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(timeout=30)


def _row(assets) -> list:  # noqa: F811
    x, _ = smoke_data(assets, "digits", rows=1)
    return [int(v) for v in x[0]]


def test_a_version_slower_than_the_p99_bar_is_refused_before_any_traffic_moves(assets, served, v1_serving):  # noqa: F811
    state_root, port = served
    messages: list[str] = []
    with _Client(port, _row(assets)) as client, pytest.raises(DeploymentError) as refused:
        _deploy(assets, served, "v2", _settings(port, gate={"p99_ms": 0.001}), log=messages.append)
    assert "(gate)" in str(refused.value) and "above the gate's 0.001 ms (serving.gate.p99_ms)" in str(refused.value)
    assert "version v1 keeps serving" in str(refused.value)
    outcome = refused.value.outcome
    gate = outcome["gate"]
    assert not gate["passed"] and gate["bars"]["p99_ms"] == 0.001
    assert gate["new"]["requests"] > 0 and gate["serving"]["requests"] > 0  # both measured, side by side
    assert outcome["canary"] == [] and outcome["status"] == "rolled_back"
    assert outcome["rolled_back"]["step"] == "gate" and outcome["rolled_back"]["serving"] == "v1"
    assert any("gate" in m and "new v2" in m and "serving v1" in m for m in messages)  # in the task log
    # The gateway answered from v1 throughout; v1 never stopped, v2 did.
    assert client.seen and set(client.seen) == {(200, "v1")}
    assert _active(state_root)["pid"] == v1_serving["pid"] and alive(v1_serving["pid"])
    v2 = json.loads((state_root / "digits" / "versions" / "v2.json").read_text())
    assert v2["status"] == "failed" and not alive(v2["pid"])


def test_a_canary_failing_at_50_percent_is_rolled_back_and_the_stable_version_serves_all(
        assets, served, v1_serving):  # noqa: F811
    state_root, port = served
    killed: list[int] = []
    stop = threading.Event()

    def stop_the_canary_at_50() -> None:  # its server dies when the split reaches 50 %
        while not stop.is_set():
            try:
                canary = _active(state_root).get("canary") or {}
            except (OSError, ValueError):
                canary = {}
            if canary.get("percent") == 50:
                os.kill(canary["pid"], signal.SIGKILL)
                killed.append(canary["pid"])
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=stop_the_canary_at_50)
    watcher.start()
    try:
        with _Client(port, _row(assets)) as client, pytest.raises(DeploymentError) as failed:
            _deploy(assets, served, "v2", _settings(port))
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert killed, "the split never reached 50 %"
    assert "(canary at 50 %)" in str(failed.value) and "error rate" in str(failed.value)
    assert "all traffic is back on it" in str(failed.value)
    outcome = failed.value.outcome
    assert [(s["percent"], s["passed"]) for s in outcome["canary"]] == [(10, True), (50, False)]
    at_10, at_50 = outcome["canary"]
    assert 0 < at_10["canary"]["requests"] < at_10["stable"]["requests"]
    assert at_50["canary"]["failures"] > 0 and at_50["stable"]["failures"] == 0
    assert outcome["rolled_back"] == {"step": "canary at 50 %", "reason": outcome["rolled_back"]["reason"],
                                      "serving": "v1"}
    active = _active(state_root)
    assert "canary" not in active and active["pid"] == v1_serving["pid"]
    # What clients saw fail named v2 (the canary's share); v1 answered every request sent to it, and
    # serves everything again.
    assert {v for _, v in client.seen} <= {"v1", "v2"}
    assert all(version == "v2" for status, version in client.seen if status != 200)
    assert any(version == "v1" for _, version in client.seen)
    url = predict_url(f"http://127.0.0.1:{port}", "digits")
    answers = [http_call("POST", url, {"instances": [_row(assets)]}) for _ in range(20)]
    assert {(status, headers["X-Model-Version"]) for status, _, headers in answers} == {(200, "v1")}


def test_a_good_version_takes_every_step_and_the_old_one_is_retired_after_the_check_after_promotion(
        assets, served, v1_serving):  # noqa: F811
    state_root, port = served
    messages: list[str] = []
    with _Client(port, _row(assets)) as client:
        result = _deploy(assets, served, "v2", _settings(port), log=messages.append)
    assert (result["status"], result["previous_version"], result["rolled_back"]) == ("deployed", "v1", None)
    assert result["gate"]["passed"] and result["gate"]["serving"]["requests"] > 0
    assert [(s["percent"], s["passed"]) for s in result["canary"]] == [(10, True), (50, True), (100, True)]
    at_50, after = result["canary"][1:]
    assert after["stable"] == at_50["stable"]  # after promotion: judged against v1's figures of the last step
    assert all(status == 200 for status, _ in client.seen) and {v for _, v in client.seen} == {"v1", "v2"}
    # v1 was stopped only after the check after promotion passed.
    promoted = next(i for i, m in enumerate(messages) if "after promotion" in m)
    retired = next(i for i, m in enumerate(messages) if "previous version v1" in m and "stopped" in m)
    assert promoted < retired and not alive(v1_serving["pid"])
    assert _active(state_root)["version"] == "v2" and "canary" not in _active(state_root)
    # Deployed again: nothing changes.
    again = _deploy(assets, served, "v2", _settings(port))
    assert again == {**result, "status": "kept"} and alive(result["pid"])
