"""Serving: the model server, the stable router, and blue/green deploys through a fixed port.

Every process a test starts is stopped by pid in a finalizer (``stop_endpoint`` for deploys).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from hybridflow.compression import compress_model, load_compressed
from hybridflow.datasets import DIGITS_FEATURES, LABEL, parse_split
from hybridflow.errors import DeploymentError
from hybridflow.serving.deploy import deploy, endpoint_status, stop_endpoint
from hybridflow.training.model import build_model

ENDPOINT = "digits"


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


def _call(method: str, url: str, body=None, raw: bytes | None = None, timeout: float = 10.0):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def _start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", *args], stdout=fh, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def assets(trained, tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    model, test_csv = trained
    compress_model(model, test_csv, root / "compressed", mode="best", max_accuracy_drop=0.02)
    frame = pd.read_csv(test_csv)
    random_model = root / "random.pt"
    torch.save(build_model().state_dict(), random_model)  # untrained: ~10% accuracy
    garbage = root / "garbage.pt"
    garbage.write_bytes(b"this is not a model" * 10)
    return {
        "root": root,
        "test_csv": test_csv,
        "fp32": model,
        "int8": root / "compressed" / "model-int8.pt",
        "random": random_model,
        "garbage": garbage,
        "pixels": frame[DIGITS_FEATURES].to_numpy(dtype=np.int64),
        "labels": frame[LABEL].to_numpy(dtype=np.int64),
    }


@pytest.fixture(scope="module")
def server(assets, tmp_path_factory):
    """The int8 artefact served as version s1 on a free port picked by the server itself."""
    folder = tmp_path_factory.mktemp("server")
    ready = folder / "ready.json"
    proc = _start(
        [
            "hybridflow.serving.server",
            "--model",
            str(assets["int8"]),
            "--variant",
            "int8",
            "--version",
            "s1",
            "--port",
            "0",
            "--host",  # what a pod is given (as 0.0.0.0): the flag's address is the one bound
            "127.0.0.1",
            "--ready-file",
            str(ready),
        ],
        folder / "server.log",
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.is_file():
            assert proc.poll() is None, (folder / "server.log").read_text()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        assert info["pid"] == proc.pid
        yield f"http://127.0.0.1:{info['port']}"
    finally:
        _stop(proc)


def test_server_health_and_predictions_for_known_rows(server, assets):
    status, body, _ = _call("GET", f"{server}/healthz")
    assert (status, body["status"], body["version"]) == (200, "ok", "s1")

    rows = assets["pixels"][:100]
    status, body, headers = _call("POST", f"{server}/predict", {"instances": rows.tolist()})
    assert status == 200 and body["version"] == "s1" and headers["X-Model-Version"] == "s1"
    predictions = np.asarray(body["predictions"])
    # Same answers as the artefact gives in-process on the scaled features.
    x, _ = parse_split(assets["test_csv"].read_bytes())
    assert np.array_equal(predictions, load_compressed(assets["int8"], "int8")(x[:100]))
    assert np.mean(predictions == assets["labels"][:100]) > 0.9


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ({"instances": [[0] * 63]}, "64 pixel values"),
        ({"instances": [[0] * 63 + ["x"]]}, "not a number"),
        ({"instances": [[0] * 63 + [True]]}, "not a number"),
        ({"instances": [[0] * 63 + [17]]}, "pixel range"),
        ({"instances": [[0] * 64] * 1025}, "at most 1024"),
        ({"instances": []}, "non-empty"),
        ({"rows": [[0] * 64]}, "instances"),
        ([[0] * 64], "instances"),
    ],
)
def test_server_rejects_bad_input_with_400(server, payload, needle):
    status, body, _ = _call("POST", f"{server}/predict", payload)
    assert status == 400
    assert needle in body["error"]


def test_server_rejects_non_json_and_unknown_routes(server):
    status, body, _ = _call("POST", f"{server}/predict", raw=b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]
    status, body, _ = _call("GET", f"{server}/nope")
    assert status == 404 and "error" in body
    # Still serving after bad requests.
    assert _call("GET", f"{server}/healthz")[0] == 200


def test_router_without_active_backend_answers_503(tmp_path):
    port = _free_port()
    proc = _start(
        ["hybridflow.serving.router", "--state-dir", str(tmp_path), "--port", str(port)],
        tmp_path / "router.log",
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, body, _ = _call("GET", f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert status == 503 and body["router"] is True and "deploy one" in body["error"]
        status, body, _ = _call("POST", f"http://127.0.0.1:{port}/predict", {"instances": [[0] * 64]})
        assert status == 503 and "error" in body
        # A hand-edited active.json naming a non-loopback host is not followed.
        (tmp_path / "active.json").write_text(json.dumps({"version": "x", "url": "http://10.0.0.1:80"}))
        status, body, _ = _call("POST", f"http://127.0.0.1:{port}/predict", {"instances": [[0] * 64]})
        assert status == 503 and "127.0.0.1" in body["error"]
    finally:
        _stop(proc)


@pytest.fixture
def endpoint(tmp_path, request):
    state_root = tmp_path / "state"
    request.addfinalizer(lambda: stop_endpoint(state_root, ENDPOINT))
    return state_root, _free_port()


def _recorded_pids(state_root: Path) -> list[int]:
    folder = state_root / ENDPOINT
    records = [folder / "router.json", *(folder / "versions").glob("*.json")]
    return [json.loads(p.read_text())["pid"] for p in records if p.is_file()]


def test_blue_green_deploys_through_a_stable_port(endpoint, assets):
    state_root, port = endpoint
    url = f"http://127.0.0.1:{port}"
    smoke = (assets["pixels"][:120], assets["labels"][:120])
    messages: list[str] = []

    def go(model: Path, variant: str, version: str) -> dict:
        return deploy(
            model,
            variant,
            version,
            state_root=state_root,
            endpoint=ENDPOINT,
            port=port,
            smoke=smoke,
            min_smoke_accuracy=0.85,
            log=messages.append,
        )

    first = go(assets["fp32"], "fp32", "v1")
    assert first["endpoint_url"] == url and first["version"] == "v1" and first["previous_version"] is None
    assert first["smoke_accuracy"] >= 0.85 and 0 < first["p50_ms"] <= first["p95_ms"]
    status, body, _ = _call("POST", f"{url}/predict", {"instances": smoke[0][:5].tolist()})
    assert status == 200 and body["version"] == "v1"
    v1_pid = first["pid"]

    # Traffic keeps flowing through the stable port while v2 replaces v1.
    seen: list[tuple[int, str | None]] = []
    done = threading.Event()

    def traffic() -> None:
        while not done.is_set() and len(seen) < 5000:
            try:
                status, body, _ = _call("POST", f"{url}/predict", {"instances": smoke[0][:1].tolist()})
                seen.append((status, body.get("version")))
            except OSError as exc:
                seen.append((0, str(exc)))
            time.sleep(0.01)

    client = threading.Thread(target=traffic)
    client.start()
    try:
        second = go(assets["int8"], "int8", "v2")
    finally:
        done.set()
        client.join(timeout=30)
    assert second["version"] == "v2" and second["previous_version"] == "v1"
    assert seen and all(status == 200 for status, _ in seen), [s for s in seen if s[0] != 200][:3]
    assert "v1" in {v for _, v in seen} and {v for _, v in seen} <= {"v1", "v2"}
    status, body, headers = _call("GET", f"{url}/healthz")
    assert status == 200 and body["version"] == "v2"
    status, body, headers = _call("POST", f"{url}/predict", {"instances": smoke[0][:5].tolist()})
    assert status == 200 and body["version"] == "v2" and headers["X-Model-Version"] == "v2"
    assert not _running(v1_pid)
    v2_pid = second["pid"]

    # Re-deploying the active version changes nothing and returns the same result.
    assert go(assets["int8"], "int8", "v2") == second
    assert _running(v2_pid)
    assert any("nothing to do" in m for m in messages)

    # A model that fails the smoke accuracy never gets traffic, and its process is stopped.
    with pytest.raises(DeploymentError, match="smoke accuracy") as failed:
        go(assets["random"], "fp32", "v3")
    assert "v2 keeps serving" in str(failed.value)
    v3 = json.loads((state_root / ENDPOINT / "versions" / "v3.json").read_text())
    assert v3["status"] == "failed" and not _running(v3["pid"])

    # A model file that does not even load fails at start-up, with the server's own error.
    with pytest.raises(DeploymentError, match="not a model artefact"):
        go(assets["garbage"], "fp32", "v4")

    status, body, _ = _call("POST", f"{url}/predict", {"instances": smoke[0][:5].tolist()})
    assert status == 200 and body["version"] == "v2"
    assert json.loads((state_root / ENDPOINT / "active.json").read_text())["version"] == "v2"
    assert _running(v2_pid)

    status_now = endpoint_status(state_root, ENDPOINT)
    assert status_now["active_version"] == "v2" and status_now["healthy"]
    assert status_now["versions"]["v2"]["running"] and not status_now["versions"]["v1"]["running"]

    pids = _recorded_pids(state_root)
    stopped = stop_endpoint(state_root, ENDPOINT)
    assert v2_pid in stopped["stopped_pids"]
    assert not any(_running(pid) for pid in pids)
    assert endpoint_status(state_root, ENDPOINT)["active_version"] is None


def test_first_deploy_failure_leaves_nothing_active(endpoint, assets):
    state_root, port = endpoint
    with pytest.raises(DeploymentError, match="no version was serving"):
        deploy(
            assets["random"],
            "fp32",
            "v1",
            state_root=state_root,
            endpoint=ENDPOINT,
            port=port,
            smoke=(assets["pixels"][:50], assets["labels"][:50]),
            min_smoke_accuracy=0.85,
            log=None,
        )
    assert not (state_root / ENDPOINT / "active.json").exists()
    assert not any(_running(pid) for pid in _recorded_pids(state_root))


def test_deploy_refuses_a_port_held_by_something_else(endpoint, assets):
    state_root, _ = endpoint
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        # Answers nothing useful: the deploy must fail before switching and stop its new server.
        with pytest.raises(DeploymentError):
            deploy(
                assets["fp32"],
                "fp32",
                "v1",
                state_root=state_root,
                endpoint=ENDPOINT,
                port=port,
                smoke=(assets["pixels"][:50], assets["labels"][:50]),
                min_smoke_accuracy=0.85,
            )
    assert not (state_root / ENDPOINT / "active.json").exists()
    assert not any(_running(pid) for pid in _recorded_pids(state_root))
