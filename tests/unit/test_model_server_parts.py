"""The model server's parts that run without a server: dynamic batching (concurrent calls share forward
passes, each gets its own rows, a failing pass fails only its own callers), the server's Python and the
``serving.server`` settings as its flags."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest

from hybridflow.config.pipeline import ModelServerSettings
from hybridflow.errors import DeploymentError
from hybridflow.serving import runtime
from hybridflow.serving.batching import Batcher
from hybridflow.serving.server import _parser


class Model:
    """Row sums, recording each forward pass's rows and thread; ``fail`` passes raise."""

    def __init__(self, fail: int = 0) -> None:
        self.passes: list[int] = []
        self.threads: set[int] = set()
        self.fail = fail

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.passes.append(len(x))
        self.threads.add(threading.get_ident())
        if self.fail:
            self.fail -= 1
            raise RuntimeError("out of memory")
        return x.sum(axis=1)


def _rows(i: int, n: int = 1) -> np.ndarray:
    return np.full((n, 3), float(i), dtype=np.float32)


def test_concurrent_calls_share_forward_passes_and_each_gets_its_own_rows():
    model = Model()

    async def main() -> list[np.ndarray]:
        batcher = Batcher(model, max_batch_size=8, max_wait_s=0.05)
        try:
            return await asyncio.gather(*(batcher.predict(_rows(i, 1 + i % 2)) for i in range(20)))
        finally:
            await batcher.close()

    answers = asyncio.run(main())
    for i, y in enumerate(answers):
        assert y.tolist() == [3.0 * i] * (1 + i % 2)
    assert sum(model.passes) == 30 and max(model.passes) <= 8
    assert len(model.passes) <= 5  # 30 rows in batches of at most 8, not one pass per call
    assert threading.get_ident() not in model.threads  # off the event loop


def test_a_call_bigger_than_a_batch_runs_alone_and_a_lone_call_waits_at_most_max_wait():
    model = Model()

    async def main() -> tuple[np.ndarray, float]:
        batcher = Batcher(model, max_batch_size=4, max_wait_s=0.2)
        try:
            big = await batcher.predict(_rows(2, 10))
            start = asyncio.get_running_loop().time()
            await batcher.predict(_rows(1))
            return big, asyncio.get_running_loop().time() - start
        finally:
            await batcher.close()

    big, lone_s = asyncio.run(main())
    assert big.tolist() == [6.0] * 10 and model.passes == [10, 1]
    assert 0.15 < lone_s < 1.0


def test_a_failing_forward_pass_fails_its_callers_and_the_next_batch_is_served():
    model = Model(fail=1)

    async def main() -> tuple[list, np.ndarray]:
        batcher = Batcher(model, max_batch_size=8, max_wait_s=0.05)
        try:
            first = await asyncio.gather(*(batcher.predict(_rows(i)) for i in range(3)), return_exceptions=True)
            return first, await batcher.predict(_rows(5))
        finally:
            await batcher.close()

    first, after = asyncio.run(main())
    assert [str(e) for e in first] == ["out of memory"] * 3
    assert after.tolist() == [15.0]


def test_a_caller_that_gave_up_does_not_stop_the_others():
    model = Model()

    async def main() -> list:
        batcher = Batcher(model, max_batch_size=8, max_wait_s=0.1)
        try:
            gone = asyncio.ensure_future(batcher.predict(_rows(1)))
            stays = asyncio.ensure_future(batcher.predict(_rows(2)))
            await asyncio.sleep(0.01)
            gone.cancel()  # its request timed out
            return [await stays, await batcher.predict(_rows(3))]
        finally:
            await batcher.close()

    stays, later = asyncio.run(main())
    assert stays.tolist() == [6.0] and later.tolist() == [9.0]


def test_server_args_are_the_flags_the_server_reads():
    settings = ModelServerSettings(max_batch_size=16, max_batch_wait_ms=2.5, max_instances=300, max_body_mib=0.5,
                                   request_timeout_s=7)
    args = _parser().parse_args(["--bundle", "b", "--endpoint", "e", "--version", "v", "--port", "0",
                                 *runtime.server_args(settings)])
    assert {f: getattr(args, f) for f in runtime.FLAGS} == settings.model_dump()


def test_serve_python_names_the_environment_or_the_fix(tmp_path, monkeypatch):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setenv(runtime.SERVE_PYTHON_ENV, str(python))
    assert runtime.serve_python() == str(python)
    monkeypatch.setenv(runtime.SERVE_PYTHON_ENV, str(tmp_path / "missing"))
    with pytest.raises(DeploymentError, match="not an executable Python"):
        runtime.serve_python()
    monkeypatch.delenv(runtime.SERVE_PYTHON_ENV)
    monkeypatch.setattr(runtime, "SERVE_VENV", tmp_path / "no-venv")
    with pytest.raises(DeploymentError, match="scripts/bootstrap.sh"):
        runtime.serve_python()
    monkeypatch.setattr(runtime, "SERVE_VENV", runtime.REPO_ROOT / ".venv-serve")
    assert os.access(runtime.serve_python(), os.X_OK)  # bootstrap made it
