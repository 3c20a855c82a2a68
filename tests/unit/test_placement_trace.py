"""The trace replay: same rules as the product, any trace of the openb format, and the sovereignty count."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from hybridflow.settings import REPO_ROOT

SPEC = importlib.util.spec_from_file_location("placement_trace", REPO_ROOT / "benchmarks" / "placement_trace.py")
trace = importlib.util.module_from_spec(SPEC)
sys.modules["placement_trace"] = trace
SPEC.loader.exec_module(trace)

POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"


def write_trace(tmp_path: Path, rows: list[tuple[int, str, int, int, int | str]]) -> tuple[Path, Path]:
    pods = tmp_path / "pods.csv"
    pods.write_text(POD_HEADER + "".join(
        f"pod-{i:03d},1000,1024,{gpus},1000,,{qos},Running,{created},{deleted},{scheduled}\n"
        for i, (gpus, qos, created, deleted, scheduled) in enumerate(rows)
    ))
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n-{i},64000,262144,2,T4\n" for i in range(4)))
    return pods, nodes


def by_policy(rows: list[dict]) -> dict[str, dict]:
    return {r["policy"].split(" (")[0]: r for r in rows}


def test_replay_compares_policies_and_keeps_restricted_data_private(tmp_path: Path, capsys) -> None:
    # 40 one-GPU tasks of an hour each, all at once, on a 4-GPU private cluster; one task without GPUs.
    rows = [(1, "LS" if i % 2 else "BE", i, i + 3600, i) for i in range(40)] + [(0, "LS", 0, 10, 0)]
    pods, nodes = write_trace(tmp_path, rows)
    out = by_policy(trace.main([str(pods), str(nodes), "--private-gpus", "4", "--restricted-share", "0.5",
                                "--interruptible-share", "0.5", "--seed", "3"]))
    printed = capsys.readouterr().out
    assert "40 GPU runs replayed (1 without GPUs" in printed and "| policy |" in printed
    ours, fifo, public, cheap = out["ours"], out["always-private FIFO"], out["always-public on-demand"], out["cheapest-first"]
    restricted = public["violations"]
    assert 5 < restricted < 35  # the seeded share marks about half
    assert ours["violations"] == 0 and fifo["violations"] == 0
    assert cheap["violations"] > 0 and cheap["spot_misuse"] > 0
    assert ours["spot_misuse"] == 0
    # FIFO on 4 GPUs queues 36 one-hour tasks; ours spills the unrestricted ones, so waits are shorter.
    assert fifo["p95_wait_s"] > ours["p95_wait_s"] and fifo["mean_wait_s"] > ours["mean_wait_s"]
    assert public["mean_wait_s"] == 0 and public["private_util"] == 0
    assert public["total_usd"] > ours["total_usd"]


def test_restricted_gang_waits_rather_than_failing_over(tmp_path: Path) -> None:
    # A 2-GPU private cluster busy for 10 h; every task restricted: all wait, none leaves private.
    rows = [(2, "LS", 0, 36_000, 0), (1, "LS", 10, 3610, 10), (2, "BE", 20, 3620, 20)]
    pods, nodes = write_trace(tmp_path, rows)
    out = by_policy(trace.main([str(pods), str(nodes), "--private-gpus", "2", "--restricted-share", "1.0"]))
    assert out["ours"]["violations"] == 0 and out["ours"]["public_share"] == 0
    assert out["ours"]["failovers"] == 0
    assert out["ours"]["mean_wait_s"] > 10_000


def test_unrestricted_gang_fails_over_after_the_admission_timeout(tmp_path: Path) -> None:
    # Private idle below the threshold at arrival, but the 2-GPU gang cannot start: after the
    # timeout it is placed again with the private cluster excluded, and starts on public.
    rows = [(1, "LS", 0, 36_000, 0), (2, "LS", 5, 3605, 5)]
    pods, nodes = write_trace(tmp_path, rows)
    out = by_policy(trace.main([str(pods), str(nodes), "--private-gpus", "2", "--restricted-share", "0",
                                "--spill-threshold", "0.9", "--admission-timeout-s", "60"]))
    assert out["ours"]["failovers"] == 1
    assert out["ours"]["mean_wait_s"] == pytest.approx(30)  # waits 0 and 60 s (the timeout)


def test_bad_trace_file_is_refused(tmp_path: Path) -> None:
    pods, nodes = write_trace(tmp_path, [(0, "LS", 0, 10, 0)])
    with pytest.raises(SystemExit, match="no task with GPUs"):
        trace.main([str(pods), str(nodes)])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--restricted-share", "1.5"], "--restricted-share must be between 0 and 1"),
        (["--private-gpus", "0"], "--private-gpus and --admission-timeout-s must be at least 1"),
        (["--prices", "/nonexistent.csv"], "/nonexistent.csv: no such file"),
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    pods, nodes = write_trace(tmp_path, [(1, "LS", 0, 10, 0)])
    with pytest.raises(SystemExit):
        trace.main([str(pods), str(nodes), *args])
    assert message in capsys.readouterr().err
