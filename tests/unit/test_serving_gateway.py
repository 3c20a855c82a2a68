"""The model gateway and blue/green deploys of two example models through one gateway port. Everything
binds 127.0.0.1; every process a test starts is stopped by pid in a finalizer (``stop_gateway`` for
deploys). The deploys here run the gate and the check after promotion with short windows and bars
any server meets (:data:`QUICK`); tests/unit/test_serving_canary.py holds the canary and gate tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from tests.support.serving import (  # noqa: F401 (fixture)
    assets,
    gate_metric,
    http_call,
    predict_url,
    smoke_data,
    start_module,
    stop_process,
)

from hybridflow.bundle import read_card
from hybridflow.config import ServingSettings
from hybridflow.errors import DeploymentError
from hybridflow.serving.deploy import deploy, endpoint_status, stop_endpoint, stop_gateway
from hybridflow.serving.egress import served_bytes
from hybridflow.serving.server import InputSchema

# Bars any server meets, short windows, all traffic at once: these tests are about the gateway.
QUICK = {"gate": {"p99_ms": 10_000, "min_rps": 1, "max_p99_regression": 1000, "concurrency": 2, "duration_s": 0.3},
         "canary": {"steps": [100], "window_s": 0.2, "concurrency": 2}}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reaped-later child still has a /proc entry)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def test_gateway_without_backends(tmp_path):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_module(["hybridflow.serving.router", "--state-root", str(tmp_path), "--port", str(port)],
                        tmp_path / "gateway.log")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, body, _ = http_call("GET", f"{base}/healthz", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert status == 200 and body["router"] is True and body["state_root"] == str(tmp_path.resolve())
        assert body["endpoints"] == {}
        status, body, _ = http_call("POST", predict_url(base, "digits"), {"instances": [[0] * 64]})
        assert status == 404 and "known endpoints: none" in body["error"]
        status, body, _ = http_call("GET", f"{base}/predict")
        assert status == 404 and "/v1/models/<endpoint>:predict" in body["error"]

        (tmp_path / "digits" / "versions").mkdir(parents=True)  # deployed to once, nothing active now
        status, body, _ = http_call("POST", predict_url(base, "digits"), {"instances": [[0] * 64]})
        assert status == 503 and "deploy one" in body["error"]
        status, body, _ = http_call("GET", f"{base}/v1/models/cancer")
        assert status == 404 and "known endpoints: digits" in body["error"]
        # A hand-edited active.json naming a non-loopback host is not followed.
        (tmp_path / "digits" / "active.json").write_text(json.dumps({"version": "x", "url": "http://10.0.0.1:80"}))
        status, body, _ = http_call("POST", predict_url(base, "digits"), {"instances": [[0] * 64]})
        assert status == 503 and "names no backend the gateway may forward to" in body["error"]
        assert http_call("GET", f"{base}/healthz")[1]["endpoints"] == {"digits": None}
    finally:
        stop_process(proc)


def _recorded_pids(folder: Path) -> list[int]:
    """Processes recorded under a state root (gateway and versions) or under one endpoint's folder."""
    records = [folder / "router.json", *folder.glob("*/versions/*.json"), *folder.glob("versions/*.json")]
    return [json.loads(p.read_text())["pid"] for p in records if p.is_file()]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A state root and gateway port shared by the deploy tests; everything under it stopped after."""
    state_root = tmp_path_factory.mktemp("gateway") / "state"
    yield state_root, _free_port()
    pids = _recorded_pids(state_root)
    stop_gateway(state_root)
    assert not any(_running(pid) for pid in pids)


def _deploy(assets, gateway, endpoint: str, version: str, bundle_key: str | None = None, log=None) -> dict:  # noqa: F811
    state_root, port = gateway
    return deploy(assets[endpoint][bundle_key or version], version, state_root=state_root, endpoint=endpoint,
                  port=port, smoke=smoke_data(assets, endpoint), metric=gate_metric(endpoint), log=log,
                  serving=ServingSettings.model_validate({**QUICK, "port": port}))


def _ensure_both(assets, gateway) -> None:  # noqa: F811
    """digits v1 or v2 and breast-cancer b1 active (a no-op when a previous test left them so)."""
    state_root, _ = gateway
    active = json.loads((state_root / "digits" / "active.json").read_text()).get("version") \
        if (state_root / "digits" / "active.json").is_file() else None
    _deploy(assets, gateway, "digits", active or "v1")
    _deploy(assets, gateway, "breast-cancer", "b1")


def test_two_endpoints_deployed_at_once_share_one_gateway(assets, gateway):  # noqa: F811
    state_root, port = gateway
    base = f"http://127.0.0.1:{port}"
    messages: list[str] = []
    # Both deploys find no gateway and race to start it: the lock at the root lets exactly one start.
    with ThreadPoolExecutor(2) as pool:
        digits, cancer = pool.map(lambda ev: _deploy(assets, gateway, *ev, log=messages.append),
                                  [("digits", "v1"), ("breast-cancer", "b1")])
    assert sum("started the model gateway" in m for m in messages) == 1
    # The gateway holds requests to the model servers' bounds (serving.server).
    gateway_pid = json.loads((state_root / "router.json").read_text())["pid"]
    args = Path(f"/proc/{gateway_pid}/cmdline").read_bytes().decode().split("\0")
    assert float(args[args.index("--max-body-mib") + 1]) == 8, args
    assert float(args[args.index("--request-timeout-s") + 1]) == 10, args
    assert digits["endpoint_url"] == f"{base}/v1/models/digits" and digits["previous_version"] is None
    assert cancer["endpoint_url"] == f"{base}/v1/models/breast-cancer"
    assert digits["smoke_metric"]["name"] == "accuracy" and digits["smoke_metric"]["value"] >= 0.85
    assert cancer["smoke_metric"] == {"name": "roc_auc", "value": cancer["smoke_metric"]["value"], "gate": 0.95}
    assert cancer["smoke_metric"]["value"] >= 0.95 and 0 < cancer["p50_ms"] <= cancer["p99_ms"]
    # The gate measured it (nothing served before it) and the check after promotion passed.
    assert cancer["gate"]["passed"] and cancer["gate"]["serving"] is None and cancer["gate"]["new"]["requests"] > 0
    assert [(s["percent"], s["passed"]) for s in cancer["canary"]] == [(100, True)]
    assert (cancer["status"], cancer["rolled_back"], cancer["target"]) == ("deployed", None, "local")
    assert (digits["model"], cancer["model"], cancer["variant"]) == ("digits-mlp", "breast-cancer", "fp16")

    sent: dict[tuple[str, str], int] = {}
    for endpoint, version in (("digits", "v1"), ("breast-cancer", "b1")):
        x, _ = smoke_data(assets, endpoint, rows=5)
        rows = InputSchema(read_card(assets[endpoint][version]).signature).instances(x)
        status, body, headers = http_call("POST", predict_url(base, endpoint), {"instances": rows})
        assert status == 200 and (body["model"], body["version"], headers["X-Model-Version"]) == \
            (endpoint, version, version)
        assert len(body["predictions"]) == 5
        sent[(endpoint, version)] = int(headers["Content-Length"])
    # The gateway counts the bytes it serves out per endpoint and version (projects' transfer quotas).
    served: dict = {}
    for _ in range(50):
        served = served_bytes(state_root, datetime.now(UTC).date())
        if all(served.get(k, 0) >= n for k, n in sent.items()):
            break
        time.sleep(0.1)
    assert all(served.get(k, 0) >= n for k, n in sent.items()), (served, sent)
    status, body, _ = http_call("GET", f"{base}/healthz")
    assert status == 200 and body["endpoints"] == {"digits": "v1", "breast-cancer": "b1"}
    status, body, _ = http_call("GET", f"{base}/v1/models/nope")
    assert status == 404 and "breast-cancer, digits" in body["error"]
    # An endpoint's 400 passes through the gateway as it is.
    status, body, _ = http_call("POST", predict_url(base, "breast-cancer"), {"instances": [[0.0] * 64]})
    assert status == 400 and "64 values; send 30" in body["error"]


def test_blue_green_replace_keeps_serving_through_the_gateway(assets, gateway):  # noqa: F811
    state_root, port = gateway
    _ensure_both(assets, gateway)
    if json.loads((state_root / "digits" / "active.json").read_text())["version"] != "v1":
        pytest.skip("digits v1 was replaced already")
    base = f"http://127.0.0.1:{port}"
    v1_pid = json.loads((state_root / "digits" / "active.json").read_text())["pid"]
    x, _ = smoke_data(assets, "digits", rows=1)
    row = [int(v) for v in x[0]]
    seen: list[tuple[int, str | None]] = []
    done = threading.Event()

    def traffic() -> None:
        while not done.is_set() and len(seen) < 5000:
            try:
                status, body, _ = http_call("POST", predict_url(base, "digits"), {"instances": [row]})
                seen.append((status, body.get("version")))
            except OSError as exc:
                seen.append((0, str(exc)))
            time.sleep(0.01)

    client = threading.Thread(target=traffic)
    client.start()
    try:
        second = _deploy(assets, gateway, "digits", "v2")
    finally:
        done.set()
        client.join(timeout=30)
    assert second["version"] == "v2" and second["previous_version"] == "v1" and second["variant"] == "int8"
    assert seen and all(status == 200 for status, _ in seen), [s for s in seen if s[0] != 200][:3]
    assert "v1" in {v for _, v in seen} and {v for _, v in seen} <= {"v1", "v2"}
    status, body, headers = http_call("POST", predict_url(base, "digits"), {"instances": [row]})
    assert status == 200 and body["version"] == "v2" and headers["X-Model-Version"] == "v2"
    assert not _running(v1_pid)
    # The other endpoint never noticed.
    assert http_call("GET", f"{base}/v1/models/breast-cancer")[1]["version"] == "b1"

    # Re-deploying the active version changes nothing and returns the same result.
    messages: list[str] = []
    assert _deploy(assets, gateway, "digits", "v2", log=messages.append) == {**second, "status": "kept"}
    assert _running(second["pid"]) and any("nothing to do" in m for m in messages)


def test_failed_versions_leave_the_active_one_serving(assets, gateway):  # noqa: F811
    state_root, port = gateway
    _ensure_both(assets, gateway)
    active = json.loads((state_root / "digits" / "active.json").read_text())
    base = f"http://127.0.0.1:{port}"

    # A model that misses its metric's gate never gets traffic, and its process is stopped.
    with pytest.raises(DeploymentError, match=r"smoke accuracy 0\.\d+ on 200 known inputs is below the gate 0.85") \
            as failed:
        _deploy(assets, gateway, "digits", "v3", "untrained")
    assert f"version {active['version']} keeps serving on {base}/v1/models/digits" in str(failed.value)
    v3 = json.loads((state_root / "digits" / "versions" / "v3.json").read_text())
    assert v3["status"] == "failed" and not _running(v3["pid"])

    # A bundle whose weights do not load fails at start-up, with the server's own error.
    with pytest.raises(DeploymentError, match=r"(?s)\(start\).*not a saved state dict"):
        _deploy(assets, gateway, "digits", "v4", "garbage")

    status, body, _ = http_call("GET", f"{base}/v1/models/digits")
    assert status == 200 and body["version"] == active["version"]
    assert json.loads((state_root / "digits" / "active.json").read_text())["pid"] == active["pid"]
    assert _running(active["pid"])


def test_status_and_orphan_free_stop(assets, gateway):  # noqa: F811
    state_root, port = gateway
    _ensure_both(assets, gateway)
    active = json.loads((state_root / "digits" / "active.json").read_text())
    status_now = endpoint_status(state_root, "digits")
    assert status_now["active_version"] == active["version"] and status_now["healthy"]
    assert status_now["endpoint_url"] == f"http://127.0.0.1:{port}/v1/models/digits"
    assert status_now["gateway"]["running"] and status_now["versions"][active["version"]]["running"]

    digits_pids = [json.loads(p.read_text())["pid"] for p in (state_root / "digits" / "versions").glob("*.json")]
    stopped = stop_endpoint(state_root, "digits")
    assert active["pid"] in stopped["stopped_pids"] and not any(_running(pid) for pid in digits_pids)
    assert endpoint_status(state_root, "digits")["active_version"] is None
    # The gateway keeps serving the other endpoint; the stopped one answers 503.
    base = f"http://127.0.0.1:{port}"
    assert http_call("GET", f"{base}/v1/models/breast-cancer")[0] == 200
    assert http_call("GET", f"{base}/v1/models/digits")[0] == 503

    pids = _recorded_pids(state_root)
    result = stop_gateway(state_root)
    assert set(result["endpoints"]) == {"digits", "breast-cancer"}
    assert not any(_running(pid) for pid in pids)
    with pytest.raises(OSError):
        http_call("GET", f"{base}/healthz", timeout=2)
    assert stop_gateway(state_root)["stopped_pids"] == []  # idempotent


def test_stop_gateway_also_stops_a_router_of_the_one_endpoint_layout(tmp_path):
    """Routers used to run per endpoint (``--state-dir ROOT/<endpoint>``, pid in its router.json)."""
    edir = tmp_path / "state" / "digits"
    (edir / "versions").mkdir(parents=True)
    legacy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "hybridflow.serving.router",
                               "--state-dir", str(edir)])
    try:
        deadline = time.monotonic() + 10
        while str(edir).encode() not in Path(f"/proc/{legacy.pid}/cmdline").read_bytes():  # until it has exec'd
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (edir / "router.json").write_text(json.dumps({"pid": legacy.pid, "port": 1}))
        assert stop_gateway(tmp_path / "state")["stopped_pids"] == [legacy.pid]
        assert legacy.wait(timeout=10) is not None
    finally:
        stop_process(legacy)


@pytest.fixture
def own_root(tmp_path):
    state_root = tmp_path / "state"
    yield state_root
    stop_gateway(state_root)


def test_first_deploy_failure_leaves_nothing_active(assets, own_root):  # noqa: F811
    with pytest.raises(DeploymentError, match="(?s)smoke roc_auc .* is below the gate 0.95.*no version was serving"):
        _deploy(assets, (own_root, port := _free_port()), "breast-cancer", "b0", "untrained")
    assert not (own_root / "breast-cancer" / "active.json").exists()
    assert not any(_running(pid) for pid in _recorded_pids(own_root / "breast-cancer"))
    # The gateway it started stays up, with nothing to forward to yet.
    status, body, _ = http_call("GET", f"http://127.0.0.1:{port}/v1/models/breast-cancer")
    assert status == 503 and "deploy one" in body["error"]


def test_deploy_refuses_a_port_held_by_something_else(assets, own_root):  # noqa: F811
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        # Answers nothing useful: the deploy must fail before switching and stop its new server.
        with pytest.raises(DeploymentError, match=r"\(gateway\)"):
            _deploy(assets, (own_root, squatter.getsockname()[1]), "breast-cancer", "b1")
    assert not (own_root / "breast-cancer" / "active.json").exists()
    assert not any(_running(pid) for pid in _recorded_pids(own_root))


def test_deploy_checks_its_arguments_before_starting_anything(assets, tmp_path):  # noqa: F811
    state_root = tmp_path / "state"
    x, y = smoke_data(assets, "digits")
    good = {"state_root": state_root, "endpoint": "digits", "port": _free_port(), "smoke": (x, y),
            "metric": gate_metric("digits")}
    v1 = assets["digits"]["v1"]
    cases = [
        ({"smoke": (x[:, :30], y)}, ValueError, r"smoke must be \(inputs \[n, 64\]"),
        ({"smoke": (x, y[:10])}, ValueError, "targets"),
        ({"smoke": (np.where(x > 0, 17, x), y)}, ValueError, "above the maximum 16"),
        ({"metric": {"name": "roc_auc", "gate": 0.9}}, ValueError, "cannot score the class output"),
        ({"metric": {"name": "precision", "gate": 0.9}}, ValueError, "unknown metric"),
        ({"endpoint": "Digits_Model"}, ValueError, "endpoint="),
        ({"port": 0}, ValueError, "port="),
    ]
    for change, error, match in cases:
        with pytest.raises(error, match=match):
            deploy(v1, "v1", **{**good, **change})
    with pytest.raises(ValueError, match="version="):
        deploy(v1, "v 1", **good)
    with pytest.raises(DeploymentError, match="not a model bundle"):
        deploy(tmp_path / "missing", "v1", **good)
    cx, cy = smoke_data(assets, "breast-cancer")
    with pytest.raises(ValueError, match="roc_auc.*both classes"):
        deploy(assets["breast-cancer"]["b1"], "b1", **{**good, "endpoint": "breast-cancer",
                                                        "smoke": (cx, np.zeros_like(cy)),
                                                        "metric": gate_metric("breast-cancer")})
    assert not state_root.exists()  # nothing was created, let alone started


def test_the_gateway_stops_on_sigint_even_when_started_with_it_ignored(tmp_path):
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hybridflow.serving.router", "--state-root", str(tmp_path),
                             "--port", str(port)], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert "gateway http://" in proc.stderr.readline()
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0  # stopped cleanly (socket closed), not left running
        proc.stderr.close()
