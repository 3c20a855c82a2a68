"""The model gateway's bounds, over real sockets on 127.0.0.1: a thousand clients that never finish their
headers or their body are cut off while everyone else is answered at once; connections beyond the cap
are refused; bodies over the limit get 413; a backend that fails is reported without its internals.
Each test starts its own gateway (``python -m hybridflow.serving.router``) and stops it by pid."""

from __future__ import annotations

import json
import resource
import socket
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from tests.support.serving import http_call, predict_url, start_module, stop_process

TIMEOUT_S = 2.0  # --request-timeout-s of the gateways here, so that slow clients are cut off quickly
SLOW_CLIENTS = 1000


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def gateway(tmp_path):
    """Start a gateway on ``tmp_path / "state"`` with extra flags -> its base URL; stopped after the test."""
    with ExitStack() as stack:

        def start(*flags: str) -> str:
            port = _free_port()
            proc = start_module(["hybridflow.serving.router", "--state-root", str(tmp_path / "state"),
                                 "--port", str(port), "--request-timeout-s", str(TIMEOUT_S), *flags],
                                tmp_path / "gateway.log")
            stack.callback(stop_process, proc)
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if http_call("GET", f"{base}/healthz", timeout=2)[0] == 200:
                        return base
                except OSError:
                    pass
                assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
                assert time.monotonic() < deadline, "the gateway did not answer within 60 s"
                time.sleep(0.05)

        (tmp_path / "state" / "digits" / "versions").mkdir(parents=True)
        yield start


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def _outcome(sock: socket.socket, deadline: float) -> bytes | None:
    """What the server sent before closing (b"" for a close or reset); None if it is still open at ``deadline``."""
    received = b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def test_a_thousand_slow_clients_are_cut_off_while_others_are_answered(gateway):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = SLOW_CLIENTS + 256  # this process holds the client ends; the gateway raises its own limit
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    base = gateway()
    port = _port(base)
    head = b"POST /v1/models/digits:predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with ExitStack() as stack:
        started = time.monotonic()
        slow = []
        for i in range(SLOW_CLIENTS):
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
            # Half never finish their headers; half send headers and a tenth of the body they announce.
            sock.sendall(head if i % 2 else head + b"Content-Length: 1000\r\n\r\n" + b"{" * 100)
            slow.append(sock)
        opened_s = time.monotonic() - started
        # Everyone else is answered at once, by the gateway itself and through its routing.
        waits = []
        for _ in range(20):
            tick = time.monotonic()
            assert http_call("GET", f"{base}/healthz", timeout=5)[0] == 200
            assert http_call("POST", predict_url(base, "digits"), {"instances": [[0]]}, timeout=5)[0] == 503
            waits.append(time.monotonic() - tick)
        assert max(waits) < 0.5, f"others waited up to {max(waits):.2f} s behind {SLOW_CLIENTS} slow clients"
        # Each slow client is cut off within the deadline (plus the time it took to open them all).
        deadline = started + opened_s + TIMEOUT_S + 3
        outcomes = [_outcome(sock, deadline) for sock in slow]
        cut_s = time.monotonic() - started
    still_open = sum(o is None for o in outcomes)
    assert still_open == 0, f"{still_open} of {SLOW_CLIENTS} slow clients still held after {cut_s:.1f} s"
    headers_only, with_body = outcomes[1::2], outcomes[0::2]
    assert all(o == b"" for o in headers_only), "a client without its headers is closed, not answered"
    assert all(o.startswith(b"HTTP/1.1 408") and b"request_timeout_s" in o for o in with_body), with_body[0]
    print(f"{SLOW_CLIENTS} slow clients opened in {opened_s:.2f} s; others answered in at most "
          f"{max(waits) * 1000:.0f} ms; all cut off {cut_s:.1f} s after the first opened")
    assert http_call("GET", f"{base}/healthz")[0] == 200


def test_connections_beyond_the_cap_are_refused_with_503(gateway):
    base = gateway("--max-connections", "20")
    port = _port(base)
    with ExitStack() as stack:
        idle = [stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10)) for _ in range(20)]
        time.sleep(0.2)  # all 20 accepted
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            answer = _outcome(extra, time.monotonic() + 5)
        assert answer is not None and answer.startswith(b"HTTP/1.1 503"), answer
        assert b"maximum of 20 connections" in answer
        for sock in idle[:5]:
            sock.close()
    deadline = time.monotonic() + 5  # closed connections free their places
    while True:
        try:
            if http_call("GET", f"{base}/healthz", timeout=2)[0] == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "the gateway kept refusing after connections closed"
        time.sleep(0.05)


def test_bodies_over_the_limit_get_413_from_the_headers_or_as_they_arrive(gateway):
    base = gateway("--max-body-mib", "1")
    port = _port(base)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/models/digits:predict HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n")
        answer = _outcome(sock, time.monotonic() + 5)
    assert answer.startswith(b"HTTP/1.1 413") and b"body is 2000000 bytes; at most 1048576" in answer, answer
    # A chunked body announces no size: it is cut off once it passes the limit.
    chunk = b"x" * 65536
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/models/digits:predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(40):  # 2.5 MiB, unless the gateway stops reading first
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = _outcome(sock, time.monotonic() + 5)
    assert answer is not None and answer.startswith(b"HTTP/1.1 413") and b"over 1048576 bytes" in answer, answer
    assert http_call("GET", f"{base}/healthz")[0] == 200


def test_a_failing_backend_gets_502_naming_the_version_and_the_cause_stays_in_the_log(gateway, tmp_path):
    base = gateway()
    dead = _free_port()  # nothing listens there
    (tmp_path / "state" / "digits" / "active.json").write_text(
        json.dumps({"version": "v7", "url": f"http://127.0.0.1:{dead}"}))
    status, body, headers = http_call("POST", predict_url(base, "digits"), {"instances": [[0] * 64]})
    assert (status, headers["X-Model-Version"]) == (502, "v7")
    assert body == {"error": "digits version v7 did not answer; the gateway's log has the cause"}
    # A hand-edited active.json naming another host: refused, and the client is not told what it holds.
    (tmp_path / "state" / "digits" / "active.json").write_text(json.dumps({"version": "v8", "url": "http://10.0.0.1"}))
    status, body, _ = http_call("POST", predict_url(base, "digits"), {"instances": [[0] * 64]})
    assert status == 503 and "10.0.0.1" not in body["error"] and "deploy it again" in body["error"]
    log = Path(tmp_path / "gateway.log").read_text()
    assert f"127.0.0.1:{dead}" in log and "10.0.0.1" in log
