"""The model server's parts that run without a server: dynamic batching (concurrent calls share forward
passes, each gets its own rows, a failing pass fails only its own callers), the server's Python and the
``serving.server`` settings as its flags."""

from __future__ import annotations

import asyncio
import os
import re
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


SIGNATURE = {"inputs": [{"name": "count", "type": "int", "min": 0, "max": 16},
                        {"name": "ratio", "type": "float", "min": 0, "max": 1}, {"name": "free", "type": "float"}],
             "output": {"name": "label", "type": "class", "classes": 2}}


@pytest.mark.parametrize(("row", "named"), [
    ([True, 0.5, 1], "instances[1] column count = true is not a number"),
    ([2, 0.5, False], "instances[1] column free = false is not a number"),
    ([2.5, 0.5, 1], "instances[1] column count = 2.5 is not a whole number"),
    ([17, 0.5, 1], "instances[1] column count = 17 is above the maximum 16"),
    ([2, -0.1, 1], "instances[1] column ratio = -0.1 is below the minimum 0"),
    ([2, 0.5, 10**400], "instances[1] column free"),
    ([2, 0.5, "1"], 'instances[1] column free = "1" is not a number'),
    ([2, 0.5], "instances[1] has 2 values; send 3"),
])
def test_rows_checked_as_whole_arrays_refuse_what_the_row_by_row_check_refuses(row, named) -> None:
    from hybridflow.serving.schema import BadRequest, InputSchema

    schema = InputSchema(SIGNATURE)
    with pytest.raises(BadRequest, match=re.escape(named)):
        schema.parse({"instances": [[1, 0.25, -3.5], row]})
    x = schema.parse({"instances": [[1, 0.25, -3.5], [16, 1.0, 2e3]]})
    as_objects = schema.parse({"instances": [{"free": -3.5, "count": 1, "ratio": 0.25},
                                             {"ratio": 1.0, "free": 2e3, "count": 16}]})
    assert x.dtype == np.float32 and x.tolist() == as_objects.tolist() == [[1, 0.25, -3.5], [16, 1.0, 2e3]]


def test_a_light_load_never_waits_for_company_and_a_load_that_fills_batches_does():
    model = Model()

    async def main() -> tuple[list[float], list[float]]:
        loop = asyncio.get_running_loop()
        batcher = Batcher(model, max_batch_size=4, max_wait_s=0.3)

        async def timed() -> float:
            start = loop.time()
            await batcher.predict(_rows(1))
            return loop.time() - start

        try:
            lone = [await timed() for _ in range(5)]
            await asyncio.gather(*(batcher.predict(_rows(i)) for i in range(4)))  # fills a batch
            return lone, [await timed() for _ in range(2)]
        finally:
            await batcher.close()

    lone, after_full = asyncio.run(main())
    assert max(lone) < 0.1  # none of the five waited the 0.3 s for rows that were not coming
    assert model.passes[:6] == [1, 1, 1, 1, 1, 4]
    # After a full batch the next one waits for more; once it comes back alone, waiting stops.
    assert after_full[0] > 0.25 and after_full[1] < 0.1
