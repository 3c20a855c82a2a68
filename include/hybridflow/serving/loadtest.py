"""Load tests of a model endpoint: requests/s, p50 and p99 and the error rate, per version that answered.

:func:`load_test` drives ``{base_url}/v1/models/{endpoint}:predict`` with single-row requests from
``concurrency`` users for ``duration_s`` and returns :class:`Figures` keyed by the version that
answered each request (the body's ``version``, else the ``X-Model-Version`` header; failures no
version can be told for under ``"?"``), plus ``"all"``. Sent through the gateway while traffic is
split, it gives the canary's and the stable version's figures from the same load.

The load generator is locust (headless), a well-kept open-source one whose users keep requests in
flight back to back, so the figures are what the server sustains, not what one Python client loop
can send. Locust runs on gevent, which monkey-patches the process it runs in, so it always runs as
a subprocess (the ``locust`` console script beside this interpreter, :mod:`locustfile` the load) and
nothing here imports it.

Resolution: locust's run time is whole seconds (``duration_s`` is rounded up); response times are
kept to three significant figures (0.123 ms, 12.3 ms, 123 ms), and p50/p99 are the nearest-rank
percentiles of those. ``rps`` is the requests answered (failures included) over the seconds from
the first answer to the last.

Everything is bounded: each request by ``request_timeout_s`` (at most half the run, so a server
that does not answer yields failures inside the run), users finish their request in flight for at
most that long once the run ends, and the whole subprocess by the sum plus a start-up allowance.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridflow.errors import DeploymentError

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
UNKNOWN = "?"
ALL = "all"
START_ALLOWANCE_S = 60.0  # locust's own start (gevent, imports) and its exit


@dataclass(frozen=True)
class Figures:
    """One version's (or everything's) figures from one load test."""

    requests: int
    failures: int
    error_rate: float
    rps: float
    p50_ms: float
    p99_ms: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Figures:
        return cls(**{k: data[k] for k in ("requests", "failures", "error_rate", "rps", "p50_ms", "p99_ms")})

    def line(self) -> str:
        return (f"{self.requests} requests, {self.rps:.1f}/s, p50 {self.p50_ms:.2f} ms, p99 {self.p99_ms:.2f} ms, "
                f"{self.failures} failed ({self.error_rate * 100:.2f} %)")


def locust_bin() -> Path:
    """The ``locust`` console script of this interpreter's environment."""
    path = Path(sys.executable).parent / "locust"
    if not path.exists():
        raise DeploymentError(f"the load generator {path} is missing: install the pinned requirements into "
                              f"{Path(sys.executable).parent.parent} (pip install -r requirements.txt)")
    return path


def percentile(histogram: Mapping[float, int], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q <= 1) of a ``{response time ms: count}`` histogram."""
    total = sum(histogram.values())
    if not total:
        return 0.0
    rank = max(1, math.ceil(q * total))
    seen = 0
    for ms in sorted(histogram):
        seen += histogram[ms]
        if seen >= rank:
            return float(ms)
    return float(max(histogram))


def figures(entries: Sequence[Mapping[str, Any]], seconds: float) -> Figures:
    """Merge locust's stats entries (its ``--json-file``) into one version's figures over ``seconds``."""
    histogram: dict[float, int] = {}
    requests = failures = 0
    for e in entries:
        requests += int(e["num_requests"])
        failures += int(e["num_failures"])
        for ms, count in (e.get("response_times") or {}).items():
            histogram[float(ms)] = histogram.get(float(ms), 0) + int(count)
    return Figures(
        requests=requests,
        failures=failures,
        error_rate=round(failures / requests, 6) if requests else 0.0,
        rps=round(requests / seconds, 3) if seconds > 0 else 0.0,
        p50_ms=percentile(histogram, 0.50),
        p99_ms=percentile(histogram, 0.99),
    )


def summarise(entries: Sequence[Mapping[str, Any]], duration_s: float) -> dict[str, Figures]:
    """Per version (locust's entry name) and ``"all"``; rps over the same window for every version."""
    starts = [e["start_time"] for e in entries if e.get("start_time")]
    ends = [e["last_request_timestamp"] for e in entries if e.get("last_request_timestamp")]
    window = max(ends) - min(starts) if starts and ends else 0.0
    seconds = window if window > 0.5 else float(duration_s)  # a single answer spans no window
    by_version: dict[str, list[Mapping[str, Any]]] = {}
    for e in entries:
        by_version.setdefault(str(e["name"]), []).append(e)
    result = {version: figures(group, seconds) for version, group in sorted(by_version.items())}
    result[ALL] = figures(entries, seconds)
    return result


def _command(base_url: str, users: int, run_s: int, stop_s: int, stats: Path) -> list[str]:
    return [
        str(locust_bin()), "-f", str(LOCUSTFILE), "--headless", "--users", str(users), "--spawn-rate", str(users * 100),
        "--run-time", f"{run_s}s", "--stop-timeout", f"{stop_s}s", "--host", base_url.rstrip("/"),
        "--json-file", str(stats), "--only-summary", "--exit-code-on-error", "0", "--loglevel", "WARNING",
    ]


def load_test(
    base_url: str,
    endpoint: str,
    rows: Sequence[Any],
    *,
    concurrency: int,
    duration_s: float,
    log: Callable[[str], Any] | None = None,
    request_timeout_s: float = 10.0,
) -> dict[str, Figures]:
    """Load ``{base_url}/v1/models/{endpoint}:predict`` with ``concurrency`` users for ``duration_s``
    (whole seconds, rounded up), one row per request; the figures per version that answered, and ``"all"``.

    Raises :class:`~hybridflow.errors.DeploymentError` when the load generator itself cannot run; a
    server that refuses, fails or does not answer gives failures, not an error."""
    rows = [r.tolist() if hasattr(r, "tolist") else r for r in rows]
    if not rows:
        raise ValueError("load_test needs at least one row to send")
    if concurrency < 1:
        raise ValueError(f"concurrency {concurrency}: use at least 1 user")
    run_s = max(1, math.ceil(duration_s))
    per_request = max(0.5, min(request_timeout_s, run_s / 2))
    stop_s = math.ceil(per_request) + 1
    with tempfile.TemporaryDirectory(prefix="hf-load-") as tmp:
        folder = Path(tmp)
        (folder / "rows.json").write_text(json.dumps(rows))
        stats = folder / "stats"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCUST_")}
        env.update(HYBRIDFLOW_LOADTEST_ROWS=str(folder / "rows.json"), HYBRIDFLOW_LOADTEST_ENDPOINT=endpoint,
                   HYBRIDFLOW_LOADTEST_TIMEOUT_S=str(per_request))
        cmd = _command(base_url, concurrency, run_s, stop_s, stats)
        if log:
            log(f"load test: {concurrency} users for {run_s} s on {base_url.rstrip('/')}/v1/models/{endpoint}:predict")
        started = time.monotonic()
        try:
            done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True,
                                  timeout=run_s + stop_s + START_ALLOWANCE_S)
        except subprocess.TimeoutExpired as exc:
            raise DeploymentError(f"the load test did not end within {exc.timeout:.0f} s (locust hung)") from exc
        out = Path(f"{stats}.json")
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr or done.stdout or "")[-1500:]
            raise DeploymentError(f"the load test could not run (locust exit {done.returncode}): {tail}")
        entries = json.loads(out.read_text())
    result = summarise(entries, run_s)
    if log:
        for version, figs in result.items():
            log(f"load test {version}: {figs.line()}")
        log(f"load test took {time.monotonic() - started:.1f} s in all")
    return result
