"""The load test against real servers on 127.0.0.1: figures per version that answered, failures counted
when a version answers 500 or nothing listens, and no hang."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybridflow.errors import DeploymentError
from hybridflow.serving import loadtest
from hybridflow.serving.loadtest import Figures, load_test, percentile, summarise

ROWS = [[float(i), float(i + 1)] for i in range(5)]


class _Split(BaseHTTPRequestHandler):
    """Endpoint ``split``: v1 and v2 answer in turn, every third v2 answer a 500, its first one among them;
    endpoint ``solo``: v1 answers everything."""

    counter = 0
    lock = threading.Lock()
    bodies: list = []
    answered: dict = {}  # (version, status) -> answers sent: what the load test must report, exactly

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            type(self).counter += 1
            n = type(self).counter
            if len(self.bodies) < 50:
                self.bodies.append((self.path, body))
        time.sleep(0.002)
        version = "v1" if "solo" in self.path or n % 2 else "v2"
        if version == "v2" and n % 6 == 2:  # v2's first answer, then every third
            self._send(500, {"error": "boom"}, version)
        else:
            self._send(200, {"predictions": [sum(body["instances"][0])], "model": "m", "version": version}, version)

    def _send(self, status, doc, version):
        with self.lock:
            self.answered[(version, status)] = self.answered.get((version, status), 0) + 1
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Model-Version", version)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Split)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_each_version_that_answers_through_a_split_gets_its_own_figures(server):
    lines = []
    _Split.answered.clear()
    result = load_test(server, "split", ROWS, concurrency=4, duration_s=2, log=lines.append)
    v1, v2, every = result["v1"], result["v2"], result["all"]
    assert set(result) == {"v1", "v2", "all"}
    # Single-row requests to the endpoint's predict route, the rows in turn.
    path, body = _Split.bodies[0]
    assert path == "/v1/models/split:predict" and body["instances"][0] in ROWS and len(body["instances"]) == 1
    # Each version's figures are exactly what the server answered as that version (how many requests
    # fit in the window depends on the machine's load; which answers are counted where does not).
    sent = dict(_Split.answered)
    assert v1.requests == sent.get(("v1", 200), 0) > 0 and v1.failures == 0
    assert v2.requests == sent.get(("v2", 200), 0) + sent.get(("v2", 500), 0) > 0
    assert v2.failures == sent.get(("v2", 500), 0) > 0 and v2.error_rate == round(v2.failures / v2.requests, 6)
    assert every.requests == v1.requests + v2.requests and every.failures == v2.failures
    assert 2 <= v1.p50_ms <= v1.p99_ms < 10_000  # the handler sleeps 2 ms; milliseconds, not seconds
    assert abs(v1.rps + v2.rps - every.rps) < 0.01 * every.rps + 0.01 and every.rps > 0
    assert any("load test v2:" in line for line in lines)


def test_a_closed_port_gives_failures_under_no_version_and_returns_promptly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the load starts
    started = time.monotonic()
    result = load_test(f"http://127.0.0.1:{port}", "m", ROWS, concurrency=2, duration_s=1)
    assert time.monotonic() - started < 30
    assert set(result) == {"?", "all"}
    assert result["?"].requests > 0 and result["?"].failures == result["?"].requests
    assert result["all"].error_rate == 1.0


def test_figures_from_locust_entries_use_nearest_rank_percentiles_and_one_window():
    hist = {"1.5": 98, "2.0": 1, "40.0": 1}
    entries = [
        {"name": "v1", "num_requests": 100, "num_failures": 1, "response_times": hist,
         "start_time": 100.0, "last_request_timestamp": 104.0},
        {"name": "v2", "num_requests": 20, "num_failures": 0, "response_times": {"3.0": 20},
         "start_time": 101.0, "last_request_timestamp": 102.0},
    ]
    result = summarise(entries, duration_s=4)
    assert result["v1"] == Figures(requests=100, failures=1, error_rate=0.01, rps=25.0, p50_ms=1.5, p99_ms=2.0)
    assert result["v2"].rps == 5.0  # over the whole run's window, not its own
    assert result["all"].requests == 120 and result["all"].p99_ms == 3.0  # rank 119 of 120
    assert percentile({}, 0.99) == 0.0
    assert Figures.from_dict(result["v1"].as_dict()) == result["v1"]


def test_a_missing_load_generator_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(loadtest.sys, "executable", str(tmp_path / "bin" / "python"))
    with pytest.raises(DeploymentError, match="requirements.txt"):
        load_test("http://127.0.0.1:9", "m", ROWS, concurrency=1, duration_s=1)


def test_a_server_that_never_answers_gives_failures_within_the_run():
    with socket.socket() as silent:  # listens (the kernel accepts) but never reads or answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        started = time.monotonic()
        result = load_test(f"http://127.0.0.1:{silent.getsockname()[1]}", "m", ROWS, concurrency=2, duration_s=1)
        took = time.monotonic() - started
    assert took < 15
    assert result["all"].requests >= 2 and result["all"].error_rate == 1.0
    assert result["all"].p50_ms >= 400  # each waited its timeout, half the run
