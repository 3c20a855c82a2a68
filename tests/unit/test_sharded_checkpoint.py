"""Sharded (DCP) checkpoints saved by every rank of a gloo gang: committed as one checkpoint only
once every rank has uploaded, restored in place on every rank, and never half-visible.

The multi-rank cases run this file as a script, one process per rank (``python <this file>
<scenario> <rank> <config.json>``); each rank writes what it saw to a JSON file the test checks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from hybridflow.storage.objectstore import LocalObjectStore
from hybridflow.training import sharded
from hybridflow.training.checkpoint import MANIFEST_NAME, CheckpointStore, latest_of, prepare, step_prefix
from hybridflow.training.sharded import ShardedCheckpointer, dcp_name, is_sharded, load_sharded, shard_name

WORLD = 2
ROWS, COLS = 16, 8
RUN_TIMEOUT_S = 90
DIE_EXIT_CODE = 17


# -- state shared by the test and the rank processes ----------------------------------------------
def _full(step: int, name: str) -> torch.Tensor:
    base = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    return (base if name == "w" else -base) + 1000.0 * step


def _state(step: int, rank: int, mesh, *, fresh: bool = False) -> dict:
    """Rank ``rank``'s state at ``step``: two matrices sharded by rows over the ranks (each rank
    holds different rows), a replicated tensor and a plain value. ``fresh``: zeros to load into."""
    from torch.distributed.tensor import DTensor, Shard

    rows = ROWS // WORLD

    def sharded_param(name: str):
        local = (
            torch.zeros(rows, COLS) if fresh else _full(step, name)[rank * rows : (rank + 1) * rows].clone()
        )
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    return {
        "model": {"w": sharded_param("w"), "v": sharded_param("v")},
        "extra": {
            "scale": torch.zeros(3) if fresh else torch.full((3,), float(step)),
            "step": -1 if fresh else step,
        },
    }


def _matches(state: dict, step: int, rank: int) -> bool:
    """Collective (full_tensor gathers): this rank's shards and the whole tensors are step's."""
    rows = ROWS // WORLD
    ok = True
    for name in ("w", "v"):
        t = state["model"][name]
        ok &= torch.equal(t.to_local(), _full(step, name)[rank * rows : (rank + 1) * rows])
        ok &= torch.equal(t.full_tensor(), _full(step, name))
    ok &= torch.equal(state["extra"]["scale"], torch.full((3,), float(step)))
    return bool(ok and state["extra"]["step"] == step)


# -- the rank processes ----------------------------------------------------------------------------
def _restore(rank: int, mesh, places: list[CheckpointStore], workdir: Path) -> dict:
    """Rank 0 picks the newest verified checkpoint in either place and tells the others."""
    import torch.distributed as dist

    found = latest_of(places) if rank == 0 else None
    chosen = [(found[0].step, found[1]) if found else None]
    dist.broadcast_object_list(chosen, src=0)
    step, index = chosen[0]
    state = _state(0, rank, mesh, fresh=True)
    manifest = load_sharded(places[index], step, state, workdir, checkpoint=found[0] if found else None)
    return {"step": step, "place": index, "ok": _matches(state, step, rank), "meta": manifest.meta}


def _scenario_save(rank, mesh, ckpt, places, cfg, out) -> None:
    for step in (1, 2, 3, 4):
        state = _state(step, rank, mesh)
        ckpt.save(step, state, {"loss": 1.0 / step})
        # Training goes on at once: the checkpoint must hold the values as of save().
        for t in state["model"].values():
            t.to_local().fill_(float("nan"))
    assert ckpt.wait(timeout=60)
    out["primary_step"] = ckpt.primary_step
    out["written"] = ckpt.summary()["written"]
    out["restored"] = _restore(rank, mesh, places, Path(cfg["workdir"]))
    fresh = _state(0, rank, mesh, fresh=True)
    load_sharded(places[1], 3, fresh, Path(cfg["workdir"]))
    out["replica_step3_ok"] = _matches(fresh, 3, rank)


def _scenario_die(rank, mesh, ckpt, places, cfg, out) -> None:
    for step in (1, 2):
        ckpt.save(step, _state(step, rank, mesh))
    assert ckpt.wait(timeout=60)

    def die(step: int, at_rank: int, place_index: int, files_done: int) -> None:
        if (step, at_rank, place_index, files_done) == (3, 1, 0, 1):
            os._exit(DIE_EXIT_CODE)  # one of rank 1's data files is in the primary, the rest never will be

    sharded._fault_after_file_upload = die
    ckpt.commit_timeout_s = 3.0  # rank 0's wait for the dead rank: short, so the test stays short
    ckpt.save(3, _state(3, rank, mesh))
    try:
        ckpt.wait(timeout=60)
        out["error"] = None
    except TimeoutError as exc:
        out["error"] = str(exc)


def _scenario_recover(rank, mesh, ckpt, places, cfg, out) -> None:
    out["restored"] = _restore(rank, mesh, places, Path(cfg["workdir"]))
    ckpt.save(3, _state(3, rank, mesh))
    assert ckpt.wait(timeout=60)
    out["restored_after"] = _restore(rank, mesh, places, Path(cfg["workdir"]))


_SCENARIOS = {"save": _scenario_save, "die": _scenario_die, "recover": _scenario_recover}


def _rank_main(scenario: str, rank: int, cfg_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cfg = json.loads(Path(cfg_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{cfg['rendezvous']}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    mesh = init_device_mesh("cpu", (WORLD,))
    places = [CheckpointStore(LocalObjectStore(Path(cfg[k]))) for k in ("primary", "replica")]
    ckpt = ShardedCheckpointer(
        places[0],
        places[1],
        rank=rank,
        world_size=WORLD,
        keep=cfg["keep"],
        workdir=Path(cfg["workdir"]),
        commit_timeout_s=cfg["commit_timeout_s"],
        writer_threads=2,  # two data files per rank, so a rank can die with only part uploaded
    )
    out: dict = {}
    _SCENARIOS[scenario](rank, mesh, ckpt, places, cfg, out)
    ckpt.close()
    result = Path(cfg["out"]) / f"rank-{rank}.json"
    result.with_suffix(".tmp").write_text(json.dumps(out))
    result.with_suffix(".tmp").replace(result)
    dist.destroy_process_group()


# -- the test side ---------------------------------------------------------------------------------
def _run_ranks(scenario: str, root: Path, *, keep: int, commit_timeout_s: float) -> tuple[list, list, str]:
    """Run ``scenario`` on two rank processes; their exit codes and result dicts (None if absent)."""
    run = root / f"run-{scenario}"
    run.mkdir()
    cfg = {
        "primary": str(root / "primary"),
        "replica": str(root / "replica"),
        "workdir": str(root / "work"),
        "rendezvous": str(run / "rendezvous"),
        "out": str(run),
        "keep": keep,
        "commit_timeout_s": commit_timeout_s,
    }
    (run / "cfg.json").write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, scenario, str(rank), str(run / "cfg.json")],
            stdout=open(run / f"rank-{rank}.log", "wb"),  # noqa: SIM115 - closed when the process ends
            stderr=subprocess.STDOUT,
            env=env,
        )
        for rank in range(WORLD)
    ]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout and p.stdout.close()
    logs = "\n".join(
        f"--- rank {r}:\n{(run / f'rank-{r}.log').read_text(errors='replace')[-3000:]}" for r in range(WORLD)
    )
    results = []
    for rank in range(WORLD):
        path = run / f"rank-{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    assert None not in codes, f"{scenario}: ranks still running after {RUN_TIMEOUT_S}s\n{logs}"
    return codes, results, logs


def _places(root: Path) -> list[CheckpointStore]:
    return [CheckpointStore(LocalObjectStore(root / name)) for name in ("primary", "replica")]


def _folder(root: Path, place: str, step: int) -> set[str]:
    folder = root / place / step_prefix(step)
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Two ranks saved steps 1-4 (keep 2) to a primary and a replica folder."""
    root = tmp_path_factory.mktemp("sharded-save")
    codes, results, logs = _run_ranks("save", root, keep=2, commit_timeout_s=30)
    assert codes == [0, 0], logs
    (root / "results.json").write_text(json.dumps(results))
    return root


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_two_ranks_commit_one_checkpoint_and_restore_it_everywhere(saved):
    results = json.loads((saved / "results.json").read_text())
    places = _places(saved)
    # Prune kept the newest two in both places; nothing of the older steps is left.
    for place, name in zip(places, ("primary", "replica"), strict=True):
        assert place.committed_steps() == [3, 4]
        assert {p.parent.name for p in (saved / name).rglob("*") if p.is_file()} == {
            step_prefix(3),
            step_prefix(4),
        }

    manifests = [place.manifest(4) for place in places]
    assert manifests[0] == manifests[1]  # the replica holds the same checkpoint
    manifest = manifests[0]
    attempt = manifest.meta["attempt"]
    assert is_sharded(manifest)
    assert manifest.meta == {"kind": "sharded", "world_size": 2, "attempt": attempt, "loss": 0.25}
    # One manifest lists both ranks' DCP files (two writer threads each), DCP's metadata and both
    # ranks' records; nothing else is in the folder.
    names = {s.name for s in manifest.shards}
    assert {dcp_name(n) for n in names} == {
        None,
        ".metadata",
        "__0_0.distcp",
        "__0_1.distcp",
        "__1_0.distcp",
        "__1_1.distcp",
    }
    assert {n for n in names if dcp_name(n) is None} == {
        f"rank-00000-{attempt}.json",
        f"rank-00001-{attempt}.json",
    }
    assert _folder(saved, "primary", 4) == names | {MANIFEST_NAME}

    # Every rank restored the newest (rank 0 chose it, from the primary) with identical tensors,
    # and step 3 from the replica as well.
    for rank, out in enumerate(results):
        assert out["restored"]["step"] == 4 and out["restored"]["place"] == 0, out
        assert out["restored"]["ok"], f"rank {rank} restored other values"
        assert out["replica_step3_ok"], f"rank {rank} restored other values from the replica"
        assert out["written"] == 4
    assert results[0]["primary_step"] == 4 and results[1]["primary_step"] is None
    # Local staging files are deleted once uploaded.
    assert [p for p in (saved / "work").rglob("*") if p.is_file()] == []

    # DCP reshards: one process without a process group reads the whole tensors back.
    whole = {
        "model": {"w": torch.zeros(ROWS, COLS), "v": torch.zeros(ROWS, COLS)},
        "extra": {"scale": torch.zeros(3), "step": -1},
    }
    load_sharded(places[1], 4, whole, saved / "single")
    assert torch.equal(whole["model"]["w"], _full(4, "w")) and torch.equal(whole["model"]["v"], _full(4, "v"))
    assert whole["extra"]["step"] == 4


def test_a_rank_dying_mid_upload_leaves_no_checkpoint_and_a_rerun_commits(tmp_path):
    codes, results, logs = _run_ranks("die", tmp_path, keep=5, commit_timeout_s=30)
    assert codes == [0, DIE_EXIT_CODE], logs
    # Rank 0 uploaded its part, waited for rank 1's, and failed loudly instead of committing.
    assert results[1] is None
    assert "ranks [1] did not finish uploading" in results[0]["error"], results[0]

    places = _places(tmp_path)
    partial = _folder(tmp_path, "primary", 3)
    dead_attempt = next(n for n in partial if n.startswith("rank-00000-"))[len("rank-00000-") : -len(".json")]
    assert MANIFEST_NAME not in partial
    assert {dcp_name(n) for n in partial if "__1_" in n} == {"__1_0.distcp"}  # part of rank 1's files
    assert not any(n.startswith("rank-00001-") for n in partial)
    assert MANIFEST_NAME not in _folder(tmp_path, "replica", 3)
    found = latest_of(places)
    assert found is not None and (found[0].step, found[1]) == (2, 0)

    # A rerun resumes from step 2, saves step 3 again and commits it; the dead attempt's files go.
    codes, results, logs = _run_ranks("recover", tmp_path, keep=5, commit_timeout_s=30)
    assert codes == [0, 0], logs
    for rank, out in enumerate(results):
        assert (out["restored"]["step"], out["restored"]["ok"]) == (2, True), (rank, out)
        assert (out["restored_after"]["step"], out["restored_after"]["ok"]) == (3, True), (rank, out)
    for place_name, place in zip(("primary", "replica"), places, strict=True):
        manifest = place.manifest(3)
        assert manifest.meta["attempt"] != dead_attempt
        assert _folder(tmp_path, place_name, 3) == {s.name for s in manifest.shards} | {MANIFEST_NAME}
        assert place.committed_steps() == [1, 2, 3]


def test_a_corrupt_shard_of_the_newest_step_falls_back(saved, tmp_path):
    root = tmp_path / "copy"
    for name in ("primary", "replica"):
        shutil.copytree(saved / name, root / name)
    places = _places(root)
    data_shard = next(s.name for s in places[0].manifest(4).shards if dcp_name(s.name) == "__1_0.distcp")

    def corrupt(place: str) -> None:
        path = root / place / step_prefix(4) / data_shard
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF  # same size: only the SHA-256 can tell
        path.write_bytes(bytes(raw))

    corrupt("primary")
    found = latest_of(places)
    assert found is not None and (found[0].step, found[1]) == (4, 1)  # the replica's copy verifies
    with pytest.raises(ValueError, match="corrupt"):
        load_sharded(places[0], 4, {}, tmp_path / "work")
    corrupt("replica")
    found = latest_of(places)
    assert found is not None and (found[0].step, found[1]) == (3, 0)


def test_load_sharded_refuses_checkpoints_it_cannot_read(tmp_path):
    place = CheckpointStore(LocalObjectStore(tmp_path / "ckpt"))
    place.save(1, {"model.pt": b"full state from rank 0"})
    with pytest.raises(ValueError, match="not a sharded checkpoint"):
        load_sharded(place, 1, {}, tmp_path / "work")
    place.save(2, {shard_name(".metadata", "0123abcd"): b"x"}, {"kind": "sharded"})
    with pytest.raises(ValueError, match="world size is unreadable"):
        load_sharded(place, 2, {}, tmp_path / "work")
    place.save(3, {shard_name(".metadata", "0123abcd"): b"x"}, {"kind": "sharded", "world_size": 2})
    with pytest.raises(ValueError, match="lists 0 rank records"):
        load_sharded(place, 3, {}, tmp_path / "work")
    with pytest.raises(ValueError, match="not committed"):
        load_sharded(place, 4, {}, tmp_path / "work")


def test_commit_manifest_needs_every_shard_listed_with_its_size(tmp_path):
    store = LocalObjectStore(tmp_path / "ckpt")
    place = CheckpointStore(store)
    manifest = prepare(5, {"a.bin": b"aaaa", "b.bin": b"bb"}).manifest
    store.put_bytes(f"{step_prefix(5)}/a.bin", b"aaaa")
    with pytest.raises(ValueError, match="b.bin is not in"):
        place.commit_manifest(manifest)
    store.put_bytes(f"{step_prefix(5)}/b.bin", b"b")
    with pytest.raises(ValueError, match="has size 1"):
        place.commit_manifest(manifest)
    assert place.committed_steps() == []
    store.put_bytes(f"{step_prefix(5)}/b.bin", b"bb")
    place.commit_manifest(manifest)
    loaded = place.load(5)
    assert loaded.shards == {"a.bin": b"aaaa", "b.bin": b"bb"}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_single_process_round_trip_and_reserved_meta(tmp_path):
    """World size 1 without a process group: the same protocol, and the caller cannot shadow the
    keys the manifest meta reserves."""
    places = _places(tmp_path)
    state = {"w": torch.arange(6.0), "n": 7}
    with ShardedCheckpointer(
        places[0], places[1], rank=0, world_size=1, keep=1, workdir=tmp_path / "work"
    ) as ckpt:
        with pytest.raises(ValueError, match="reserved"):
            ckpt.save(1, state, {"world_size": 3})
        ckpt.save(1, state, {"epoch": 0})
        ckpt.save(2, {"w": torch.arange(6.0) * 2, "n": 8})
        assert ckpt.wait(timeout=30) and not ckpt.busy
        assert ckpt.primary_step == 2 and ckpt.last_step == 2
    for place in places:
        assert place.committed_steps() == [2]
    fresh = {"w": torch.zeros(6), "n": 0}
    manifest = load_sharded(places[1], 2, fresh, tmp_path / "work")
    assert manifest.meta["world_size"] == 1
    assert torch.equal(fresh["w"], torch.arange(6.0) * 2) and fresh["n"] == 8


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
