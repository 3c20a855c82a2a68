"""On a machine with GPUs: a 2-rank gang of the digits example on CUDA with NCCL, bf16 and FSDP,
resumed from its checkpoint, and its training pace against the same gang on CPU with gloo.

Runs the gangs through the local backend as the train task does (``HYBRIDFLOW_DEVICE=cuda``: a rank
that cannot use its GPU fails at start, naming the cause), with the run setting precision bf16,
optimizer adamw, sharding zero3. Steps/s is the training loop's own pace (``loop_steps`` /
``loop_seconds`` in result.json: no interpreter start, data loading or final checkpoint). A machine
with fewer than two CUDA devices has nothing to check: it says so and exits 0.

    .venv/bin/python benchmarks/gpu_check.py [--steps 400] [--hidden 4096] [--every 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "include"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SETTING = {"precision": "bf16", "optimizer": "adamw", "sharding": "zero3"}
RANKS = 2


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gang(work: Path, name: str, base: dict, device: str, steps: int, every: int) -> dict:
    """One gang run to ``steps`` on ``device`` (cuda or cpu); its result.json."""
    from hybridflow.backends.local import GangJob, LocalGangBackend
    from hybridflow.storage.objectstore import LocalObjectStore, StoreSpec
    from hybridflow.training.context import RESULT_KEY

    ckpt = work / f"ckpt-{name}"
    spec = {**base, "run_key": name, "checkpoint_store": StoreSpec(kind="local", root=str(ckpt)).to_dict(),
            "checkpoint_every_steps": every, "log_every_steps": every,
            "model": {**base["model"], "hyperparameters": {**base["model"]["hyperparameters"], "steps": steps}}}
    backend = LocalGangBackend(work / "state", "gpu-check", capacity=RANKS)
    backend.run(GangJob(name=name, workers=RANKS, spec=spec, attempt=f"to-{steps}",
                        env={"HYBRIDFLOW_DEVICE": device}),
                admission_timeout_s=30, log=lambda line: print(f"  {line}", flush=True))
    return json.loads(LocalObjectStore(ckpt).get_bytes(RESULT_KEY))


def pace(result: dict) -> float:
    return result["loop_steps"] / max(result["loop_seconds"], 1e-9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()
    found = cuda_devices()
    if found < RANKS:
        print(f"gpu_check: {found} CUDA device(s) visible here, {RANKS} needed: nothing to check on this machine")
        return 0

    from checkpoint_overhead import seeded

    with tempfile.TemporaryDirectory(prefix="hf-gpu-check-") as tmp:
        work = Path(tmp)
        model, dataset, data = seeded(work)
        base = {"model": {"name": model.name, "entrypoint": model.entrypoint,
                          "hyperparameters": {**model.defaults(), "hidden": args.hidden}},
                "dataset": dataset, "data": data, "training": SETTING, "keep": 2}
        half = max(args.every, args.steps // 2 // args.every * args.every)
        print(f"gpu: {RANKS} ranks, {SETTING}, to step {half}")
        first = gang(work, "gpu", base, "cuda", half, args.every)
        print(f"gpu: resume from step {half} to {args.steps}")
        resumed = gang(work, "gpu", base, "cuda", args.steps, args.every)
        print(f"cpu: {RANKS} ranks, {SETTING}, to step {half}")
        cpu = gang(work, "cpu", base, "cpu", half, args.every)
    checks = {
        "trained on cuda with nccl": first["device"].startswith("cuda") and first["backend"] == "nccl",
        "resumed from its checkpoint": (resumed["start_step"], resumed["final_step"]) == (half, args.steps),
        "the run's setting applied": first["training"] == SETTING == resumed["training"],
    }
    for what, ok in checks.items():
        print(f"{'ok ' if ok else 'FAILED'} {what}")
    gpu_pace, cpu_pace = pace(first), pace(cpu)
    print(f"{first['device_name']}: {gpu_pace:.1f} steps/s; cpu: {cpu_pace:.1f} steps/s; "
          f"gpu/cpu {gpu_pace / cpu_pace:.1f}x (hidden {args.hidden}, {RANKS} ranks, bf16, FSDP)")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
