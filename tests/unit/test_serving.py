"""Serving any model bundle: the model server's API and request validation, the model gateway, and
blue/green deploys of two example models (digits: 64 int columns, class output; breast-cancer: 30
float columns, probability output) through one gateway port.

Everything binds 127.0.0.1; every process a test starts is stopped by pid in a finalizer
(``stop_gateway`` for deploys).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from tests.support import bundles

from hybridflow import scoring
from hybridflow.bundle import Predictor, read_card, write_bundle
from hybridflow.errors import DeploymentError
from hybridflow.serving.deploy import deploy, endpoint_status, stop_endpoint, stop_gateway
from hybridflow.serving.server import BadRequest, InputSchema, make_handler

# The served digits bundle declares its pixels as the dataset holds them: whole numbers 0..16.
INT_DIGITS = {"inputs": [{"name": "pixel_{0..63}", "type": "int", "min": 0, "max": 16}],
              "output": {"name": "digit", "type": "class", "classes": 10}}
MODELS = {"digits": "digits-mlp", "breast-cancer": "breast-cancer"}  # endpoint -> registered model
WAIT_S = 120  # bound on any server start (importing torch on a busy machine)


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


def _predict_url(base: str, endpoint: str) -> str:
    return f"{base}/v1/models/{endpoint}:predict"


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


# --------------------------------------------------------------------------- bundles


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Both example models trained briefly, as bundles of several versions and variants."""
    root = tmp_path_factory.mktemp("serving")
    digits = bundles.seed("digits-mlp", root / "digits-data")
    cancer = bundles.seed("breast-cancer", root / "cancer-data")
    digits_module = bundles.train("digits-mlp", digits)
    cancer_module = bundles.train("breast-cancer", cancer)
    make = bundles.make_bundle
    garbage = write_bundle(root / "digits-garbage", b"this is not a state dict" * 10,
                           bundles.card("digits-mlp", version="v4", signature=INT_DIGITS))
    return {
        "data": {"digits": digits, "breast-cancer": cancer},
        "digits": {
            "v1": make(root / "digits-v1", "digits-mlp", digits_module, version="v1", signature=INT_DIGITS),
            "v2": make(root / "digits-v2", "digits-mlp", digits_module, variant="int8", version="v2",
                       signature=INT_DIGITS),
            "untrained": make(root / "digits-untrained", "digits-mlp", bundles.train("digits-mlp", digits, steps=0),
                              version="v3", signature=INT_DIGITS),
            "garbage": garbage,
        },
        "breast-cancer": {
            "b1": make(root / "cancer-b1", "breast-cancer", cancer_module, variant="fp16", version="b1"),
            # Untrained, its roc_auc on the held-out split is below the registered gate of 0.95.
            "untrained": make(root / "cancer-untrained", "breast-cancer",
                              bundles.train("breast-cancer", cancer, steps=0), version="b0"),
        },
    }


def _smoke(assets, endpoint: str, rows: int = 200):
    return assets["data"][endpoint].xy("test", rows)


def _metric(endpoint: str) -> dict:
    return bundles.entry(MODELS[endpoint]).metric.model_dump(mode="json")


# --------------------------------------------------------------------------- the model server


@pytest.fixture(scope="module")
def servers(assets, tmp_path_factory):
    """digits v1 and breast-cancer b1, each on a free port its server picks itself."""
    folder = tmp_path_factory.mktemp("servers")
    procs, urls = {}, {}
    try:
        for endpoint, bundle_dir in (("digits", assets["digits"]["v1"]), ("breast-cancer", assets["breast-cancer"]["b1"])):
            version = read_card(bundle_dir).version
            procs[endpoint] = _start(
                ["hybridflow.serving.server", "--bundle", str(bundle_dir), "--endpoint", endpoint,
                 "--version", version, "--port", "0",
                 "--host", "127.0.0.1",  # what a pod is given (as 0.0.0.0): the flag's address is the one bound
                 "--ready-file", str(folder / f"{endpoint}.ready")],
                folder / f"{endpoint}.log",
            )
        deadline = time.monotonic() + WAIT_S
        for endpoint, proc in procs.items():
            ready = folder / f"{endpoint}.ready"
            while not ready.is_file():
                assert proc.poll() is None, (folder / f"{endpoint}.log").read_text()
                assert time.monotonic() < deadline, f"{endpoint} server did not start"
                time.sleep(0.1)
            info = json.loads(ready.read_text())
            assert info["pid"] == proc.pid and info["endpoint"] == endpoint
            urls[endpoint] = f"http://127.0.0.1:{info['port']}"
        yield urls
    finally:
        for proc in procs.values():
            _stop(proc)


@pytest.mark.parametrize(("endpoint", "version", "variant"), [("digits", "v1", "fp32"), ("breast-cancer", "b1", "fp16")])
def test_server_health_and_metadata(servers, assets, endpoint, version, variant):
    base = servers[endpoint]
    status, body, _ = _call("GET", f"{base}/healthz")
    assert status == 200
    assert {k: body[k] for k in ("status", "endpoint", "version", "variant", "model")} == \
        {"status": "ok", "endpoint": endpoint, "version": version, "variant": variant, "model": MODELS[endpoint]}
    status, body, headers = _call("GET", f"{base}/v1/models/{endpoint}")
    card = read_card(assets[endpoint][version])
    assert status == 200 and headers["X-Model-Version"] == version
    assert body == {"name": endpoint, "ready": True, "version": version, "inputs": card.input_names,
                    "output": card.output}


@pytest.mark.parametrize("endpoint", ["digits", "breast-cancer"])
def test_server_predictions_match_the_bundle_in_process(servers, assets, endpoint):
    version = "v1" if endpoint == "digits" else "b1"
    x, y = _smoke(assets, endpoint, rows=None)
    predictor = Predictor.load(assets[endpoint][version])
    schema = InputSchema(predictor.card.signature)
    rows = schema.instances(x)
    status, body, headers = _call("POST", _predict_url(servers[endpoint], endpoint), {"instances": rows})
    assert status == 200 and headers["X-Model-Version"] == version
    assert (body["model"], body["version"]) == (endpoint, version)
    served = np.asarray(body["predictions"])
    expected = predictor.predict(x)
    if endpoint == "digits":
        assert served.dtype.kind == "i" and np.array_equal(served, expected)
    else:
        assert served.dtype.kind == "f" and np.allclose(served, expected, rtol=1e-5, atol=1e-6)
    metric = _metric(endpoint)
    assert scoring.metric_value(metric["name"], y, served, predictor.output) >= metric["gate"]

    # Object-form instances ({column: value}, any key order) get the same answers.
    names = predictor.input_names
    objects = [dict(reversed(list(zip(names, row, strict=True)))) for row in rows[:20]]
    status, body, _ = _call("POST", _predict_url(servers[endpoint], endpoint), {"instances": objects})
    assert status == 200 and np.allclose(body["predictions"], served[:20])


def _with(row: list, j: int, value) -> list:
    return row[:j] + [value] + row[j + 1:]


def _bad_requests(endpoint: str, row: list, names: list[str]) -> list[tuple[str, object, list[str]]]:
    """(case, body, phrases the 400 error must contain) for a valid ``row`` of the endpoint's model."""
    n, col = len(row), names[5]
    obj = dict(zip(names, row, strict=True))
    cases = [
        ("too few values", {"instances": [row[:-1]]}, ["instances[0]", f"{n - 1} values", f"send {n}", names[0]]),
        ("too many values", {"instances": [row + [1]]}, ["instances[0]", f"{n + 1} values"]),
        ("second instance", {"instances": [row, row[:3]]}, ["instances[1]", "3 values"]),
        ("string", {"instances": [_with(row, 5, "3")]}, [f"instances[0] column {col}", "not a number"]),
        ("bool", {"instances": [_with(row, 5, True)]}, [f"column {col}", "not a number"]),
        ("null", {"instances": [_with(row, 5, None)]}, [f"column {col}", "not a number"]),
        ("nested", {"instances": [_with(row, 5, [1])]}, [f"column {col}", "not a number"]),
        ("NaN", {"instances": [_with(row, 5, float("nan"))]}, [f"column {col}", "not finite"]),
        ("Infinity", {"instances": [_with(row, 5, float("inf"))]}, [f"column {col}", "not finite"]),
        ("overflowing int", {"instances": [_with(row, 5, 10**400)]}, [f"column {col}", "not finite"]),
        ("below min", {"instances": [row, _with(row, 5, -1)]}, [f"instances[1] column {col}",
                                                                 "below the minimum 0"]),
        ("unknown column", {"instances": [{**obj, "colour": 1}]}, ["instances[0]", "unknown column", "colour"]),
        ("missing column", {"instances": [{k: v for k, v in obj.items() if k != col}]},
         ["instances[0]", "missing column", col]),
        ("bad object value", {"instances": [{**obj, col: "high"}]}, [f"instances[0] column {col}", "not a number"]),
        ("not a row", {"instances": ["abc"]}, ["instances[0]", "str", f"list of {n} values"]),
        ("too many instances", {"instances": [row] * 1025}, ["1025 rows", "at most 1024"]),
        ("no instances", {"instances": []}, ["non-empty"]),
        ("no instances key", {"rows": [row]}, ["instances"]),
        ("not an object", [row], ["instances"]),
    ]
    if endpoint == "digits":  # int inputs with a maximum
        cases += [
            ("fraction", {"instances": [_with(row, 5, 2.5)]}, [f"column {col}", "not a whole number"]),
            ("above max", {"instances": [_with(row, 5, 17)]}, [f"column {col}", "above the maximum 16"]),
        ]
    return cases


@pytest.mark.parametrize("endpoint", ["digits", "breast-cancer"])
def test_server_rejects_bad_instances_with_400_naming_instance_and_column(servers, assets, endpoint):
    x, _ = _smoke(assets, endpoint, rows=1)
    schema = InputSchema(read_card(assets[endpoint]["v1" if endpoint == "digits" else "b1"]).signature)
    row = schema.instances(x)[0]
    url = _predict_url(servers[endpoint], endpoint)
    for case, body, phrases in _bad_requests(endpoint, row, schema.names):
        status, answer, _ = _call("POST", url, body)
        assert status == 400, (case, answer)
        assert all(p in answer["error"] for p in phrases), (case, answer["error"])
    # Integral floats are whole numbers; the server still serves after all of that.
    whole = [float(v) for v in row]
    assert _call("POST", url, {"instances": [whole]})[0] == 200


def test_server_limits_and_routes(servers):
    base = servers["digits"]
    url = _predict_url(base, "digits")
    status, body, _ = _call("POST", url, raw=b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]
    for method, path in (("GET", "/nope"), ("POST", "/predict"), ("POST", "/v1/models/other:predict"),
                         ("GET", "/v1/models/other")):
        status, body, _ = _call(method, f"{base}{path}", {"instances": []} if method == "POST" else None)
        assert status == 404, path
        assert "GET /healthz" in body["error"] and "POST /v1/models/digits:predict" in body["error"]
    status, body, headers = _call("GET", url)
    assert status == 405 and headers["Allow"] == "POST"

    def raw_post(headers: dict[str, str]) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), timeout=10)
        try:
            conn.putrequest("POST", "/v1/models/digits:predict", skip_accept_encoding=True)
            for key, value in headers.items():
                conn.putheader(key, value)
            conn.endheaders()
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    status, body = raw_post({"Content-Type": "application/json"})
    assert status == 411 and "Content-Length" in body["error"]
    status, body = raw_post({"Content-Length": str(10**9)})
    assert status == 413 and "at most" in body["error"]
    assert _call("GET", f"{base}/healthz")[0] == 200


def test_bool_inputs_accept_true_and_false_only():
    schema = InputSchema({"inputs": [{"name": "smoker", "type": "bool"}, {"name": "age", "type": "int", "min": 0}],
                          "output": {"name": "risk", "type": "value"}})
    x = schema.parse({"instances": [[True, 40], {"age": 7, "smoker": False}]})
    assert x.dtype == np.float32 and x.tolist() == [[1.0, 40.0], [0.0, 7.0]]
    assert schema.instances(x) == [[True, 40], [False, 7]]
    for value in (1, 0, "true", None):
        with pytest.raises(BadRequest, match=r"instances\[0\] column smoker = .* is not a boolean; send true or false"):
            schema.parse({"instances": [[value, 40]]})


def test_a_failing_prediction_answers_500_and_the_server_keeps_serving(assets):
    from http.server import ThreadingHTTPServer

    class Flaky:
        card = read_card(assets["digits"]["v1"])
        calls = 0

        def predict(self, x):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("out of memory")
            return np.zeros(len(x), dtype=np.int64)

    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(Flaky(), "digits", "t1"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = _predict_url(f"http://127.0.0.1:{server.server_address[1]}", "digits")
        status, body, _ = _call("POST", url, {"instances": [[0] * 64]})
        assert status == 500 and "out of memory" in body["error"]
        status, body, _ = _call("POST", url, {"instances": [[0] * 64]})
        assert status == 200 and body["predictions"] == [0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


# --------------------------------------------------------------------------- the model gateway


def test_gateway_without_backends(tmp_path):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start(["hybridflow.serving.router", "--state-root", str(tmp_path), "--port", str(port)],
                  tmp_path / "gateway.log")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, body, _ = _call("GET", f"{base}/healthz", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert status == 200 and body["router"] is True and body["state_root"] == str(tmp_path.resolve())
        assert body["endpoints"] == {}
        status, body, _ = _call("POST", _predict_url(base, "digits"), {"instances": [[0] * 64]})
        assert status == 404 and "known endpoints: none" in body["error"]
        status, body, _ = _call("GET", f"{base}/predict")
        assert status == 404 and "/v1/models/<endpoint>:predict" in body["error"]

        (tmp_path / "digits" / "versions").mkdir(parents=True)  # deployed to once, nothing active now
        status, body, _ = _call("POST", _predict_url(base, "digits"), {"instances": [[0] * 64]})
        assert status == 503 and "deploy one" in body["error"]
        status, body, _ = _call("GET", f"{base}/v1/models/cancer")
        assert status == 404 and "known endpoints: digits" in body["error"]
        # A hand-edited active.json naming a non-loopback host is not followed.
        (tmp_path / "digits" / "active.json").write_text(json.dumps({"version": "x", "url": "http://10.0.0.1:80"}))
        status, body, _ = _call("POST", _predict_url(base, "digits"), {"instances": [[0] * 64]})
        assert status == 503 and "127.0.0.1" in body["error"]
        assert _call("GET", f"{base}/healthz")[1]["endpoints"] == {"digits": None}
    finally:
        _stop(proc)


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


def _deploy(assets, gateway, endpoint: str, version: str, bundle_key: str | None = None, log=None) -> dict:
    state_root, port = gateway
    return deploy(assets[endpoint][bundle_key or version], version, state_root=state_root, endpoint=endpoint,
                  port=port, smoke=_smoke(assets, endpoint), metric=_metric(endpoint), log=log)


def _ensure_both(assets, gateway) -> None:
    """digits v1 or v2 and breast-cancer b1 active (a no-op when a previous test left them so)."""
    state_root, _ = gateway
    active = json.loads((state_root / "digits" / "active.json").read_text()).get("version") \
        if (state_root / "digits" / "active.json").is_file() else None
    _deploy(assets, gateway, "digits", active or "v1")
    _deploy(assets, gateway, "breast-cancer", "b1")


def test_two_endpoints_deployed_at_once_share_one_gateway(assets, gateway):
    state_root, port = gateway
    base = f"http://127.0.0.1:{port}"
    messages: list[str] = []
    # Both deploys find no gateway and race to start it: the lock at the root lets exactly one start.
    with ThreadPoolExecutor(2) as pool:
        digits, cancer = pool.map(lambda ev: _deploy(assets, gateway, *ev, log=messages.append),
                                  [("digits", "v1"), ("breast-cancer", "b1")])
    assert sum("started the model gateway" in m for m in messages) == 1
    assert digits["endpoint_url"] == f"{base}/v1/models/digits" and digits["previous_version"] is None
    assert cancer["endpoint_url"] == f"{base}/v1/models/breast-cancer"
    assert digits["smoke_metric"]["name"] == "accuracy" and digits["smoke_metric"]["value"] >= 0.85
    assert cancer["smoke_metric"] == {"name": "roc_auc", "value": cancer["smoke_metric"]["value"], "gate": 0.95}
    assert cancer["smoke_metric"]["value"] >= 0.95 and 0 < cancer["p50_ms"] <= cancer["p95_ms"]
    assert (digits["model"], cancer["model"], cancer["variant"]) == ("digits-mlp", "breast-cancer", "fp16")

    for endpoint, version in (("digits", "v1"), ("breast-cancer", "b1")):
        x, _ = _smoke(assets, endpoint, rows=5)
        rows = InputSchema(read_card(assets[endpoint][version]).signature).instances(x)
        status, body, headers = _call("POST", _predict_url(base, endpoint), {"instances": rows})
        assert status == 200 and (body["model"], body["version"], headers["X-Model-Version"]) == \
            (endpoint, version, version)
        assert len(body["predictions"]) == 5
    status, body, _ = _call("GET", f"{base}/healthz")
    assert status == 200 and body["endpoints"] == {"digits": "v1", "breast-cancer": "b1"}
    status, body, _ = _call("GET", f"{base}/v1/models/nope")
    assert status == 404 and "breast-cancer, digits" in body["error"]
    # An endpoint's 400 passes through the gateway as it is.
    status, body, _ = _call("POST", _predict_url(base, "breast-cancer"), {"instances": [[0.0] * 64]})
    assert status == 400 and "64 values; send 30" in body["error"]


def test_blue_green_replace_keeps_serving_through_the_gateway(assets, gateway):
    state_root, port = gateway
    _ensure_both(assets, gateway)
    if json.loads((state_root / "digits" / "active.json").read_text())["version"] != "v1":
        pytest.skip("digits v1 was replaced already")
    base = f"http://127.0.0.1:{port}"
    v1_pid = json.loads((state_root / "digits" / "active.json").read_text())["pid"]
    x, _ = _smoke(assets, "digits", rows=1)
    row = [int(v) for v in x[0]]
    seen: list[tuple[int, str | None]] = []
    done = threading.Event()

    def traffic() -> None:
        while not done.is_set() and len(seen) < 5000:
            try:
                status, body, _ = _call("POST", _predict_url(base, "digits"), {"instances": [row]})
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
    status, body, headers = _call("POST", _predict_url(base, "digits"), {"instances": [row]})
    assert status == 200 and body["version"] == "v2" and headers["X-Model-Version"] == "v2"
    assert not _running(v1_pid)
    # The other endpoint never noticed.
    assert _call("GET", f"{base}/v1/models/breast-cancer")[1]["version"] == "b1"

    # Re-deploying the active version changes nothing and returns the same result.
    messages: list[str] = []
    assert _deploy(assets, gateway, "digits", "v2", log=messages.append) == second
    assert _running(second["pid"]) and any("nothing to do" in m for m in messages)


def test_failed_versions_leave_the_active_one_serving(assets, gateway):
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

    status, body, _ = _call("GET", f"{base}/v1/models/digits")
    assert status == 200 and body["version"] == active["version"]
    assert json.loads((state_root / "digits" / "active.json").read_text())["pid"] == active["pid"]
    assert _running(active["pid"])


def test_status_and_orphan_free_stop(assets, gateway):
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
    assert _call("GET", f"{base}/v1/models/breast-cancer")[0] == 200
    assert _call("GET", f"{base}/v1/models/digits")[0] == 503

    pids = _recorded_pids(state_root)
    result = stop_gateway(state_root)
    assert set(result["endpoints"]) == {"digits", "breast-cancer"}
    assert not any(_running(pid) for pid in pids)
    with pytest.raises(OSError):
        _call("GET", f"{base}/healthz", timeout=2)
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
        _stop(legacy)


@pytest.fixture
def own_root(tmp_path):
    state_root = tmp_path / "state"
    yield state_root
    stop_gateway(state_root)


def test_first_deploy_failure_leaves_nothing_active(assets, own_root):
    with pytest.raises(DeploymentError, match="(?s)smoke roc_auc .* is below the gate 0.95.*no version was serving"):
        _deploy(assets, (own_root, port := _free_port()), "breast-cancer", "b0", "untrained")
    assert not (own_root / "breast-cancer" / "active.json").exists()
    assert not any(_running(pid) for pid in _recorded_pids(own_root / "breast-cancer"))
    # The gateway it started stays up, with nothing to forward to yet.
    status, body, _ = _call("GET", f"http://127.0.0.1:{port}/v1/models/breast-cancer")
    assert status == 503 and "deploy one" in body["error"]


def test_deploy_refuses_a_port_held_by_something_else(assets, own_root):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        # Answers nothing useful: the deploy must fail before switching and stop its new server.
        with pytest.raises(DeploymentError, match=r"\(gateway\)"):
            _deploy(assets, (own_root, squatter.getsockname()[1]), "breast-cancer", "b1")
    assert not (own_root / "breast-cancer" / "active.json").exists()
    assert not any(_running(pid) for pid in _recorded_pids(own_root))


def test_deploy_checks_its_arguments_before_starting_anything(assets, tmp_path):
    state_root = tmp_path / "state"
    x, y = _smoke(assets, "digits")
    good = {"state_root": state_root, "endpoint": "digits", "port": _free_port(), "smoke": (x, y),
            "metric": _metric("digits")}
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
    cx, cy = _smoke(assets, "breast-cancer")
    with pytest.raises(ValueError, match="roc_auc.*both classes"):
        deploy(assets["breast-cancer"]["b1"], "b1", **{**good, "endpoint": "breast-cancer",
                                                        "smoke": (cx, np.zeros_like(cy)),
                                                        "metric": _metric("breast-cancer")})
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
