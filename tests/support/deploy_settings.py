"""``serving`` settings for tests that deploy through the pipeline: the gate's load tests and the
canary windows as short as the load tester allows, and bars a busy test machine meets, so each deploy
adds seconds, not tens of seconds, and the gate's figures do not decide a test by chance."""

from __future__ import annotations

from typing import Any

QUICK_GATE = {"p99_ms": 5000, "min_rps": 2, "max_error_rate": 0.0, "max_p99_regression": 20, "concurrency": 2,
              "duration_s": 0.5}
QUICK_CANARY = {"steps": [50, 100], "window_s": 0.5, "concurrency": 2}


def quick_serving(pipeline: dict[str, Any]) -> dict[str, Any]:
    """``pipeline`` (pipeline.yaml as a dict) with the quick gate and canary; returned for chaining."""
    serving = pipeline.setdefault("serving", {})
    serving["gate"] = {**serving.get("gate", {}), **QUICK_GATE}
    serving["canary"] = {**serving.get("canary", {}), **QUICK_CANARY}
    return pipeline
