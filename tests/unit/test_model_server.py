"""The KServe model server's bounds and batching, over HTTP on 127.0.0.1: a 50 MB body, 100k instances,
a non-numeric pixel and clients that send one byte a second each get a clear 4xx or are cut off while
the server keeps answering others; concurrent single-row requests are batched and each gets its own
answer; KServe's liveness, readiness, metrics and open inference protocol routes answer. The request
timeout is 2 s here so the slow clients are cut off quickly."""

from __future__ import annotations

import json
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from tests.support import bundles
from tests.support.serving import INT_DIGITS, http_call, predict_url, start_server, stop_process

from hybridflow.bundle import Predictor
from hybridflow.serving.schema import InputSchema

TIMEOUT_S = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, bundle folder, held-out rows as a client sends them) of one digits server."""
    root = tmp_path_factory.mktemp("model-server")
    data = bundles.seed("digits-mlp", root / "data")
    bundle_dir = bundles.make_bundle(root / "v1", "digits-mlp", bundles.train("digits-mlp", data, steps=100),
                                     version="v1", signature=INT_DIGITS)
    x, _ = data.xy("test", 64)
    rows = InputSchema(INT_DIGITS).instances(x)
    proc, base = start_server(bundle_dir, "digits", "v1", root, "--request-timeout-s", str(TIMEOUT_S),
                              "--max-batch-wait-ms", "20", "--max-batch-size", "32")
    try:
        yield base, bundle_dir, rows
    finally:
        stop_process(proc)


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def _answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the one answer on ``sock`` (the server closes after it)."""
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _metric(base: str, name: str) -> float:
    status, text = _get_text(f"{base}/metrics")
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert status == 200 and match, name
    return float(match.group(1))


def _get_text(url: str) -> tuple[int, str]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.read().decode()


def test_oversized_bodies_and_batches_get_a_4xx_saying_what_to_fix(served):
    base, _, rows = served
    # 50 MB announced: 413 from the headers alone, the body never read.
    with socket.create_connection(("127.0.0.1", _port(base)), timeout=10) as sock:
        sock.sendall(b"POST /v1/models/digits:predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 50000000\r\n\r\n")
        status, body = _answer(sock)
    assert status == 413 and "50000000 bytes" in body["error"] and "at most 8388608" in body["error"]
    # 100k instances (small enough to pass the body limit): 400 naming the limit.
    status, body, _ = http_call("POST", predict_url(base, "digits"), {"instances": [[0]] * 100_000})
    assert status == 400 and "100000 rows; at most 1024 per request" in body["error"]
    # A non-numeric pixel: 400 naming the instance and the column.
    bad = [rows[0], rows[1][:5] + ["dark"] + rows[1][6:]]
    status, body, headers = http_call("POST", predict_url(base, "digits"), {"instances": bad})
    assert status == 400 and headers["X-Model-Version"] == "v1"
    assert "instances[1] column pixel_5" in body["error"] and "not a number" in body["error"]
    assert http_call("POST", predict_url(base, "digits"), {"instances": rows[:2]})[0] == 200


def _predict_timed(base: str, rows: list) -> float:
    start = time.monotonic()
    status, body, _ = http_call("POST", predict_url(base, "digits"), {"instances": rows[:3]})
    assert status == 200 and len(body["predictions"]) == 3
    return time.monotonic() - start


def _heard(sock: socket.socket) -> bool:
    """Whether the server has answered or closed (without consuming what it sent)."""
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
        return True  # an answer, or b"" for EOF
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset
    finally:
        sock.settimeout(timeout)


@pytest.mark.parametrize("part", ["body", "headers"])
def test_a_client_sending_one_byte_a_second_is_cut_off_while_others_are_answered(served, part):
    base, _, rows = served
    body = json.dumps({"instances": rows[:1]}).encode()
    head = (f"POST /v1/models/digits:predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    at_once, slowly = (head, body) if part == "body" else (b"", head + body)
    with socket.create_connection(("127.0.0.1", _port(base)), timeout=10) as sock:
        sock.sendall(at_once)
        start = time.monotonic()
        for i in range(len(slowly)):
            if _heard(sock) or time.monotonic() - start > TIMEOUT_S + 3:
                break
            sock.sendall(slowly[i:i + 1])
            tick = time.monotonic()
            waited = _predict_timed(base, rows)  # another client meanwhile
            assert waited < 0.5, f"another client waited {waited:.2f} s behind the slow one"
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
        cut_after = time.monotonic() - start
        try:
            raw = sock.recv(65536)
        except ConnectionResetError:
            raw = b""
        except TimeoutError:
            raw = None  # still open, nothing said
    assert i < len(slowly) - 1, "the slow client sent its whole request"
    assert cut_after < TIMEOUT_S + 2, f"cut off after {cut_after:.1f} s"
    if part == "body":  # the request had started: it is answered
        assert raw.startswith(b"HTTP/1.1 408") and b"request_timeout_s" in raw, raw
    else:  # no request yet: the connection is closed
        assert raw == b"", raw


def test_concurrent_single_row_requests_are_batched_and_each_gets_its_own_answer(served):
    base, bundle_dir, rows = served
    expected = Predictor.load(bundle_dir).predict(np.asarray(rows, dtype=np.float32)).tolist()
    requests_before = _metric(base, "hybridflow_batched_requests_total")
    batches_before = _metric(base, "hybridflow_batch_rows_count")

    def one(i: int) -> tuple[int, int]:
        status, body, _ = http_call("POST", predict_url(base, "digits"), {"instances": [rows[i]]})
        assert status == 200 and body["version"] == "v1", body
        return i, body["predictions"][0]

    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = dict(pool.map(one, range(len(rows))))
    assert [answers[i] for i in range(len(rows))] == expected
    served_requests = _metric(base, "hybridflow_batched_requests_total") - requests_before
    batches = _metric(base, "hybridflow_batch_rows_count") - batches_before
    assert served_requests == len(rows)
    assert batches <= len(rows) / 2, f"{len(rows)} concurrent requests took {batches} forward passes"


def test_liveness_readiness_metrics_and_the_open_inference_protocol(served):
    base, _, rows = served
    assert http_call("GET", f"{base}/")[:2] == (200, {"status": "alive"})
    assert http_call("GET", f"{base}/v2/health/live")[:2] == (200, {"live": True})
    assert http_call("GET", f"{base}/v2/health/ready")[:2] == (200, {"ready": True})
    status, body, _ = http_call("GET", f"{base}/v2/models/digits/ready")
    assert status == 200 and body["ready"] is True
    v1 = http_call("POST", predict_url(base, "digits"), {"instances": rows[:4]})[1]["predictions"]
    tensor = {"name": "pixels", "shape": [4, 64], "datatype": "FP32", "data": [v for r in rows[:4] for v in r]}
    status, body, headers = http_call("POST", f"{base}/v2/models/digits/infer", {"inputs": [tensor]})
    assert status == 200 and headers["X-Model-Version"] == "v1"
    assert body["model_version"] == "v1" and body["outputs"][0]["data"] == v1
    tensor["data"][5] = 99  # above the signature's maximum 16: the same 400 as v1
    status, body, _ = http_call("POST", f"{base}/v2/models/digits/infer", {"inputs": [tensor]})
    assert status == 400 and "instances[0] column pixel_5" in body["error"]
    assert _metric(base, 'request_predict_seconds_count{model_name="digits"}') >= 2


def test_kserve_model_repository_extension_is_not_served(served):
    """KServe's load/unload routes take no credentials: an unload would leave the version up but empty."""
    base, _, rows = served
    for action in ("unload", "load"):
        status, body, _ = http_call("POST", f"{base}/v2/repository/models/digits/{action}", raw=b"")
        assert status == 404 and "repository extension is not served" in body["error"], (action, status, body)
    assert http_call("GET", f"{base}/v2/repository/index")[0] == 404
    status, body, _ = http_call("GET", f"{base}/healthz")
    assert status == 200 and body["ready"] is True
    assert http_call("GET", f"{base}/v2/models/digits/ready")[:2] == (200, {"name": "digits", "ready": True})
    assert http_call("POST", predict_url(base, "digits"), {"instances": rows[:1]})[0] == 200


def test_malformed_numbers_and_tensors_get_a_400_saying_what_to_fix(served):
    base, _, rows = served
    huge = "1" * 4301  # over Python's 4300-digit cap on reading an int
    raw = ('{"instances": [[' + huge + ", " + ", ".join(map(str, rows[0][1:])) + "]]}").encode()
    status, body, headers = http_call("POST", predict_url(base, "digits"), raw=raw)
    assert status == 400 and headers["X-Model-Version"] == "v1", body
    assert body["error"] == "body holds an integer of over 4300 digits; send each value as an ordinary JSON number"
    infer = f"{base}/v2/models/digits/infer"
    cases = [
        ({"name": "x", "shape": [1, 5], "datatype": "FP32", "data": [1, 2, 3, 4, 5]}, "is FP32 of shape [1, 5]"),
        ({"name": "x", "shape": [1, 64], "datatype": "FP32", "data": [1, 2]}, "does not hold [1, 64] FP32 values"),
        ({"name": "x", "shape": [1, 64], "datatype": "BYTES", "data": ["a"]}, "does not hold [1, 64] BYTES values"),
        ({"name": "x", "shape": [64], "datatype": "FP32", "data": rows[0]}, "is FP32 of shape [64]"),
    ]
    for tensor, says in cases:
        status, body, _ = http_call("POST", infer, {"inputs": [tensor]})
        assert status == 400 and says in body["error"] and "shape [n, 64]" in body["error"], (tensor, body)
    status, body, _ = http_call("POST", infer, raw=b'{"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", '
                                                   b'"data": [' + huge.encode() + b"]}]}")
    assert 400 <= status < 500, body
    assert http_call("POST", predict_url(base, "digits"), {"instances": rows[:1]})[0] == 200
