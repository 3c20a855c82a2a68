"""The load that :func:`hybridflow.serving.loadtest.load_test` runs: locust loads this file in its own
process (gevent patches the process it runs in, so nothing else imports it).

Each simulated user POSTs one row at a time, ``{"instances": [row]}``, to
``/v1/models/<endpoint>:predict`` with no pause between requests, cycling through the rows. A
response is counted under the version that answered it (the body's ``version``, else the
``X-Model-Version`` header, else ``?``), so a load sent through a gateway that splits traffic gives
each version its own figures. Anything but 200 is a failure.

Locust keeps response times in buckets of two significant figures, 1 ms wide under 100 ms, which would
read a sub-millisecond server as 0 or 1 ms; here they are kept to three significant figures instead
(0.123 ms, 12.3 ms, 123 ms).

Read from the environment: ``HYBRIDFLOW_LOADTEST_ROWS`` (a JSON file holding the rows),
``HYBRIDFLOW_LOADTEST_ENDPOINT`` and ``HYBRIDFLOW_LOADTEST_TIMEOUT_S`` (per request).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

from locust import FastHttpUser, constant, stats, task

UNKNOWN = "?"


def _bucket(ms: float) -> float:
    """A response time kept to three significant figures."""
    if ms <= 0:
        return 0
    return round(ms, 2 - math.floor(math.log10(ms)))


stats.bucket_response_time = _bucket

ENDPOINT = os.environ.get("HYBRIDFLOW_LOADTEST_ENDPOINT", "")
TIMEOUT_S = float(os.environ.get("HYBRIDFLOW_LOADTEST_TIMEOUT_S", "10"))
_rows_file = os.environ.get("HYBRIDFLOW_LOADTEST_ROWS")
BODIES = [json.dumps({"instances": [row]}).encode() for row in json.loads(Path(_rows_file).read_text())] if _rows_file \
    else [b'{"instances": []}']
_next = itertools.count()


def answered_by(resp) -> str:
    """The version that answered: the body's ``version``, else the ``X-Model-Version`` header."""
    try:
        body = json.loads(resp.content or b"null")
    except Exception:  # no body at all (a refused or cut connection), or not JSON
        body = None
    if isinstance(body, dict) and isinstance(body.get("version"), str) and body["version"]:
        return body["version"]
    headers = resp.headers
    return (headers.get("X-Model-Version") if headers else None) or UNKNOWN


def _detail(resp) -> str:
    error = getattr(resp, "error", None)
    if error is not None:
        return f"{type(error).__name__}: {error}"[:200]
    try:
        return (resp.content or b"")[:200].decode(errors="replace")
    except Exception:
        return "no body"


class Predict(FastHttpUser):
    wait_time = constant(0)
    network_timeout = TIMEOUT_S
    connection_timeout = TIMEOUT_S

    @task
    def predict(self) -> None:
        body = BODIES[next(_next) % len(BODIES)]
        with self.client.post(f"/v1/models/{ENDPOINT}:predict", data=body, name=UNKNOWN, catch_response=True,
                              headers={"Content-Type": "application/json"}) as resp:
            resp.request_meta["name"] = answered_by(resp)
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {_detail(resp)}")
