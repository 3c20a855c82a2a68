"""The model server: its API and request validation for two example models, each served on a port it
picks itself. Everything binds 127.0.0.1; every server a test starts is stopped by pid. The gateway
and blue/green deploys: test_serving_gateway.py."""

from __future__ import annotations

import http.client
import json
import textwrap

import numpy as np
import pytest
from tests.support.serving import (  # noqa: F401 (fixture)
    MODELS,
    assets,
    gate_metric,
    http_call,
    predict_url,
    smoke_data,
    start_server,
    start_servers,
    stop_process,
)

from hybridflow import scoring
from hybridflow.bundle import Predictor, read_card
from hybridflow.serving.schema import BadRequest, InputSchema

WAIT_S = 120  # bound on any server start (importing torch on a busy machine)


@pytest.fixture(scope="module")
def servers(assets, tmp_path_factory):  # noqa: F811
    """digits v1 and breast-cancer b1, each on a free port its server picks itself."""
    folder = tmp_path_factory.mktemp("servers")
    bundles = {"digits": assets["digits"]["v1"], "breast-cancer": assets["breast-cancer"]["b1"]}
    started = start_servers([(b, e, read_card(b).version, []) for e, b in bundles.items()], folder, wait_s=WAIT_S)
    try:
        yield {endpoint: base for endpoint, (_, base) in zip(bundles, started, strict=True)}
    finally:
        for proc, _ in started:
            stop_process(proc)


@pytest.mark.parametrize(("endpoint", "version", "variant"), [("digits", "v1", "fp32"), ("breast-cancer", "b1", "fp16")])
def test_server_health_and_metadata(servers, assets, endpoint, version, variant):  # noqa: F811
    base = servers[endpoint]
    status, body, _ = http_call("GET", f"{base}/healthz")
    assert status == 200
    assert {k: body[k] for k in ("status", "endpoint", "version", "variant", "model")} == \
        {"status": "ok", "endpoint": endpoint, "version": version, "variant": variant, "model": MODELS[endpoint]}
    status, body, headers = http_call("GET", f"{base}/v1/models/{endpoint}")
    card = read_card(assets[endpoint][version])
    assert status == 200 and headers["X-Model-Version"] == version
    assert body == {"name": endpoint, "ready": True, "version": version, "inputs": card.input_names,
                    "output": card.output}


@pytest.mark.parametrize("endpoint", ["digits", "breast-cancer"])
def test_server_predictions_match_the_bundle_in_process(servers, assets, endpoint):  # noqa: F811
    version = "v1" if endpoint == "digits" else "b1"
    x, y = smoke_data(assets, endpoint, rows=None)
    predictor = Predictor.load(assets[endpoint][version])
    schema = InputSchema(predictor.card.signature)
    rows = schema.instances(x)
    status, body, headers = http_call("POST", predict_url(servers[endpoint], endpoint), {"instances": rows})
    assert status == 200 and headers["X-Model-Version"] == version
    assert (body["model"], body["version"]) == (endpoint, version)
    served = np.asarray(body["predictions"])
    expected = predictor.predict(x)
    if endpoint == "digits":
        assert served.dtype.kind == "i" and np.array_equal(served, expected)
    else:
        assert served.dtype.kind == "f" and np.allclose(served, expected, rtol=1e-5, atol=1e-6)
    metric = gate_metric(endpoint)
    assert scoring.metric_value(metric["name"], y, served, predictor.output) >= metric["gate"]

    # Object-form instances ({column: value}, any key order) get the same answers.
    names = predictor.input_names
    objects = [dict(reversed(list(zip(names, row, strict=True)))) for row in rows[:20]]
    status, body, _ = http_call("POST", predict_url(servers[endpoint], endpoint), {"instances": objects})
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
def test_server_rejects_bad_instances_with_400_naming_instance_and_column(servers, assets, endpoint):  # noqa: F811
    x, _ = smoke_data(assets, endpoint, rows=1)
    schema = InputSchema(read_card(assets[endpoint]["v1" if endpoint == "digits" else "b1"]).signature)
    row = schema.instances(x)[0]
    url = predict_url(servers[endpoint], endpoint)
    for case, body, phrases in _bad_requests(endpoint, row, schema.names):
        status, answer, _ = http_call("POST", url, body)
        assert status == 400, (case, answer)
        assert all(p in answer["error"] for p in phrases), (case, answer["error"])
    # Integral floats are whole numbers; the server still serves after all of that.
    whole = [float(v) for v in row]
    assert http_call("POST", url, {"instances": [whole]})[0] == 200


def test_server_limits_and_routes(servers):
    base = servers["digits"]
    url = predict_url(base, "digits")
    status, body, _ = http_call("POST", url, raw=b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]
    for method, path in (("GET", "/nope"), ("POST", "/predict"), ("POST", "/v1/models/other:predict"),
                         ("GET", "/v1/models/other")):
        status, body, _ = http_call(method, f"{base}{path}", {"instances": []} if method == "POST" else None)
        assert status == 404, path
        assert "GET /healthz" in body["error"] and "POST /v1/models/digits:predict" in body["error"]
    status, body, headers = http_call("GET", url)
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
    assert http_call("GET", f"{base}/healthz")[0] == 200


def test_bool_inputs_accept_true_and_false_only():
    schema = InputSchema({"inputs": [{"name": "smoker", "type": "bool"}, {"name": "age", "type": "int", "min": 0}],
                          "output": {"name": "risk", "type": "value"}})
    x = schema.parse({"instances": [[True, 40], {"age": 7, "smoker": False}]})
    assert x.dtype == np.float32 and x.tolist() == [[1.0, 40.0], [0.0, 7.0]]
    assert schema.instances(x) == [[True, 40], [False, 7]]
    for value in (1, 0, "true", None):
        with pytest.raises(BadRequest, match=r"instances\[0\] column smoker = .* is not a boolean; send true or false"):
            schema.parse({"instances": [[value, 40]]})


FLAKY_SERVER = """
import sys

import numpy as np

from hybridflow.bundle import Predictor
from hybridflow.serving import server


class Flaky:
    def __init__(self, inner):
        self.card, self.calls = inner.card, 0

    def predict(self, x):
        self.calls += 1
        if self.calls in (1, 3):
            raise RuntimeError("out of memory")
        return np.zeros(len(x), dtype=np.int64)


args = server._parser().parse_args(sys.argv[1:])
server.run_server(Flaky(Predictor.load(args.bundle)), args.endpoint, args.version, port=args.port,
                  host=args.host, ready_file=args.ready_file)
"""


def test_a_failing_prediction_answers_500_and_the_server_keeps_serving(assets, tmp_path):  # noqa: F811
    script = tmp_path / "flaky_server.py"
    script.write_text(textwrap.dedent(FLAKY_SERVER))
    proc, base = start_server(assets["digits"]["v1"], "digits", "t1", tmp_path, script=script, wait_s=WAIT_S)
    try:
        url = predict_url(base, "digits")
        status, body, _ = http_call("POST", url, {"instances": [[0] * 64]})
        # The client learns where to look, not the exception's text; the server's log has the cause.
        assert status == 500 and body["error"] == "the model server failed to answer; its log has the cause"
        assert "out of memory" not in json.dumps(body) and body["version"] == "t1"
        status, body, _ = http_call("POST", url, {"instances": [[0] * 64]})
        assert status == 200 and body["predictions"] == [0]
        # The open inference protocol's route fails the same way (KServe's own handler would echo the text).
        tensor = {"name": "pixels", "shape": [1, 64], "datatype": "FP32", "data": [0] * 64}
        status, body, _ = http_call("POST", f"{base}/v2/models/digits/infer", {"inputs": [tensor]})
        assert status == 500 and body == {"error": "the model server failed to answer; its log has the cause"}
    finally:
        stop_process(proc)
    log = (tmp_path / "digits-t1.log").read_text()
    assert "prediction failed for digits version t1" in log and "RuntimeError: out of memory" in log


UNREADY_SERVER = """
import signal
import sys

from hybridflow.bundle import Predictor
from hybridflow.serving import server

model_class = server._model_class


def on_signal_unready():
    # The served model stops being ready on SIGUSR1 (as KServe's Model.ready would after a failure).
    class Model(model_class()):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            signal.signal(signal.SIGUSR1, lambda *_: setattr(self, "ready", False))

    return Model


server._model_class = on_signal_unready
args = server._parser().parse_args(sys.argv[1:])
server.run_server(Predictor.load(args.bundle), args.endpoint, args.version, port=args.port,
                  host=args.host, ready_file=args.ready_file)
"""


def test_health_answers_503_once_the_model_is_not_ready(assets, tmp_path):  # noqa: F811
    import signal
    import time

    script = tmp_path / "unready_server.py"
    script.write_text(textwrap.dedent(UNREADY_SERVER))
    proc, base = start_server(assets["digits"]["v1"], "digits", "r1", tmp_path, script=script, wait_s=WAIT_S)
    try:
        status, body, _ = http_call("GET", f"{base}/healthz")
        assert (status, body["status"], body["ready"], body["version"]) == (200, "ok", True, "r1")
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while (answer := http_call("GET", f"{base}/healthz"))[0] == 200:
            assert time.monotonic() < deadline, "health stayed 200 for a model that is not ready"
            time.sleep(0.05)
        status, body, headers = answer
        assert (status, body["status"], body["ready"], headers["X-Model-Version"]) == (503, "not ready", False, "r1")
        assert http_call("GET", f"{base}/v1/models/digits")[1]["ready"] is False
        assert http_call("GET", f"{base}/v2/models/digits/ready")[0] == 503  # KServe's own readiness agrees
    finally:
        stop_process(proc)
