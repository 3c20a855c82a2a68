"""One disaster-recovery drill on this machine, end to end, and its measured RTO and RPO.

Sets up the embedded default's shape in a temp folder: the shipped estate plus a ``role: dr``
cluster (local backend) whose store is its own S3 endpoint (``rclone serve s3`` on 127.0.0.1). A
critical run of the registered ``digits-mlp`` example model trains for real on the primary
(``--steps`` steps, a checkpoint every ``--every``), its model is served, one replication pass copies
the dataset version, the model and the newest checkpoint to the DR store, and the primary trains on
for one more checkpoint interval (the steps a takeover then loses). The drill runs its four steps as
the ``dr_drill`` DAG does (declare down, take over, fail back, judge), with the primary's storage
moved away after the declaration, and prints the figures. Before the drill a byte is flipped in a
shard of the primary's newest checkpoint (in both of its places) and of the one before it (replicated
already) and replication runs again: the DR store's objects are compared (SHA-256) before that and
after the drill, counting those lost or overwritten.

    .venv/bin/python benchmarks/dr_drill.py [--steps 200] [--every 50] [--extra-steps 20] [--workers 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "include")]

from hybridflow.config import load_estate  # noqa: E402
from hybridflow.devenv.rclone import RcloneS3Server, airflow_conn_uri  # noqa: E402
from hybridflow.settings import Settings  # noqa: E402
from hybridflow.storage.s3 import S3ObjectStore  # noqa: E402

ACCESS, SECRET = "bench-access-key", "bench-secret-key-0123"
BUCKET = "hf-dr-bench"
RUN, MODEL, ENDPOINT = "train-bench-0001", "digits-mlp", "digits"


def _config(root: Path) -> Path:
    target = root / "config"
    shutil.copytree(REPO / "config", target)
    doc = yaml.safe_load((target / "clusters.yaml").read_text())
    doc["clusters"]["dr-west"] = {
        "location": "private", "region": "dc-2", "jurisdiction": "eu", "backend": "local", "role": "dr",
        "dr": {"min_gpus": 1}, "prices": {"onprem": 0.5},
        "node_pools": [{"name": "a100", "gpu_model": "A100-80GB", "gpu_memory_gib": 80, "gpus": 2}],
        "cache": {"conn_id": "hybridflow_dr_west", "bucket": BUCKET},
    }
    (target / "clusters.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return target


def _train(settings: Settings, estate, seeded, steps: int, every: int) -> float:
    """The critical run on the primary up to ``steps`` (resuming from its own checkpoint); seconds."""
    from tests.support.jobs import job_spec

    from hybridflow.backends.local import GangJob, LocalGangBackend
    from hybridflow.placement.places import checkpoint_replica_spec, checkpoint_store_spec

    primary = estate.clusters["onprem-a"]
    spec = job_spec(seeded, Path(checkpoint_store_spec(RUN, primary, settings).root), hparams={"steps": steps},
                    checkpoint_every_steps=every, keep=3, log_every_steps=every, run_key=RUN,
                    replica_root=Path(checkpoint_replica_spec(RUN, primary, settings).root))
    started = time.monotonic()
    LocalGangBackend(settings.state_dir, "onprem-a", primary.total_gpus).run(
        GangJob(name=f"train-{RUN}", workers=1, spec=spec, attempt=f"to-{steps}", labels={"priority": "critical"}),
        admission_timeout_s=60, log=lambda _line: None)
    return time.monotonic() - started


def _primary(settings: Settings, estate, steps: int, every: int) -> dict:
    """Train, serve, replicate, then train one more checkpoint interval on the primary."""
    from tests.support.jobs import seed_example

    from hybridflow.bundle import ModelCard, write_bundle
    from hybridflow.dr.replication.replicate import replicate
    from hybridflow.dr.replication.scope import CriticalRun
    from hybridflow.placement.places import checkpoint_store_spec
    from hybridflow.training.context import FINAL_MODEL_KEY

    seeded = seed_example(settings.private_root, MODEL)
    (settings.private_root / "runs" / RUN).mkdir(parents=True)
    shutil.copy(seeded.version_path, settings.private_root / "runs" / RUN / "dataset-version.json")
    trained_s = _train(settings, estate, seeded, steps, every)
    ckpt = Path(checkpoint_store_spec(RUN, estate.clusters["onprem-a"], settings).root)
    bundle = write_bundle(settings.private_root / "runs" / RUN / "model", (ckpt / FINAL_MODEL_KEY).read_bytes(),
                          ModelCard(**seeded.model.card(), hyperparameters=seeded.model.defaults(), variant="fp32",
                                    version=RUN))
    edir = settings.state_dir / "serving" / ENDPOINT
    (edir / "versions").mkdir(parents=True)
    (edir / "versions" / f"{RUN}.json").write_text(json.dumps({"version": RUN, "bundle": str(bundle), "model": MODEL}))
    (edir / "active.json").write_text(json.dumps({"version": RUN}))
    started = time.monotonic()
    report = replicate(estate, settings, runs=[CriticalRun(RUN, "onprem-a", f"train-{RUN}")])
    if report.all_problems:
        raise SystemExit(f"replication reported problems: {[str(p) for p in report.all_problems]}")
    replicated_s = time.monotonic() - started
    _train(settings, estate, seeded, steps + every, every)  # the primary goes on after the last pass
    return {"primary_train_s": round(trained_s, 2), "replication_s": round(replicated_s, 2),
            "replicated_objects": report.objects_copied, "replicated_bytes": report.bytes_copied}


def _dr_objects(store: S3ObjectStore) -> dict[str, str]:
    """Every object in the DR store: key -> SHA-256 of its bytes."""
    import hashlib

    return {o.key: hashlib.sha256(store.get_bytes(o.key)).hexdigest() for o in store.list("")}


def _flip_a_byte(step: Path) -> None:
    shard = next(p for p in sorted(step.iterdir()) if p.name != "MANIFEST.json")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _corrupt_sources(settings: Settings, estate) -> dict:
    """A byte flipped in a shard of the primary's newest checkpoint, in both of the run's checkpoint
    places (no healthy copy is left), and of the one before it (replicated already) in the first
    place; then a replication pass: what it reports and copies."""
    from hybridflow.dr.replication.replicate import replicate
    from hybridflow.dr.replication.scope import CriticalRun
    from hybridflow.placement.places import checkpoint_replica_spec, checkpoint_store_spec

    primary = estate.clusters["onprem-a"]
    places = [Path(checkpoint_store_spec(RUN, primary, settings).root),
              Path(checkpoint_replica_spec(RUN, primary, settings).root)]
    older, newest = sorted(p.name for p in places[0].glob("step-*") if (p / "MANIFEST.json").exists())[-2:]
    for place in places:
        _flip_a_byte(place / newest)
    _flip_a_byte(places[0] / older)
    report = replicate(estate, settings, runs=[CriticalRun(RUN, "onprem-a", f"train-{RUN}")])
    return {"corrupted_source_checkpoints": [newest, older], "source_problems_reported": len(report.all_problems),
            "objects_copied": report.objects_copied}


def _drill(settings: Settings, estate, root: Path, extra_steps: int, workers: int) -> dict:
    from hybridflow.dr.drills import drill as drills
    from hybridflow.dr.drills.report import DrillMissed

    plan = drills.make_plan(estate, "bench-1", {"extra_steps": extra_steps, "workers": workers})
    drills.declare(plan, estate, settings, by="benchmark")
    for gone in ("checkpoints", "runs", "datasets"):  # the primary's storage is lost after the declaration
        (settings.private_root / gone).rename(root / f"lost-{gone}")
    shutil.rmtree(settings.home / "scratch" / "onprem-a", ignore_errors=True)
    taken = drills.take_over(plan, estate, settings)
    drills.fail_back(plan, estate, settings, by="benchmark")
    try:
        report = drills.finish(plan, estate, settings)
    except DrillMissed as exc:
        print(exc, file=sys.stderr)
        report = drills.read_report(settings.private_root, plan.drill)
    return {"status": taken.get("status"), "error": taken.get("error"), "figures": report["figures"],
            "verdict": report["verdict"], "missed": report["missed"], "targets": report["targets"],
            "checkpoint_interval_steps": report["checkpoint_interval_steps"],
            "primary_step": report["primary_step"], "resumed_step": taken["training"]["resumed_step"],
            "stepping_step": taken["training"].get("stepping_step"),
            "inference_fetch_s": round(taken["inference"]["fetched_ts"] - report["declared_ts"], 3)
            if taken.get("inference") else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="primary training steps before replication")
    parser.add_argument("--every", type=int, default=50, help="checkpoint interval of the critical run (steps)")
    parser.add_argument("--extra-steps", type=int, default=20, help="steps the resumed run trains on the DR side")
    parser.add_argument("--workers", type=int, default=1, help="gang size on the DR cluster")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dr-drill-bench-"))
    data = root / "s3"
    data.mkdir()
    try:
        with RcloneS3Server(data, ACCESS, SECRET, log_path=root / "rclone.log") as server:
            S3ObjectStore(BUCKET, endpoint_url=server.endpoint_url, access_key=ACCESS, secret_key=SECRET).ensure_bucket()
            os.environ["AIRFLOW_CONN_HYBRIDFLOW_DR_WEST"] = airflow_conn_uri(ACCESS, SECRET, server.endpoint_url)
            settings = Settings(home=root / "home", config_dir=_config(root))
            estate = load_estate(settings.config_dir, use_cache=False)
            setup = _primary(settings, estate, args.steps, args.every)
            dr_store = S3ObjectStore(BUCKET, endpoint_url=server.endpoint_url, access_key=ACCESS, secret_key=SECRET)
            before = _dr_objects(dr_store)
            corrupted = _corrupt_sources(settings, estate)
            out = {"machine": f"{platform.node()} ({os.cpu_count()} CPUs)", **setup,
                   **_drill(settings, estate, root, args.extra_steps, args.workers)}
            after = _dr_objects(dr_store)
            out["dr_store"] = {**corrupted, "objects_before": len(before), "objects_after": len(after),
                               "lost": sum(k not in after for k in before),
                               "overwritten": sum(k in after and after[k] != v for k, v in before.items())}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=2))
    f = out["figures"]
    print(f"inference RTO {f['inference_rto_s']} s (target <= {out['targets']['inference_rto_s']:g}), "
          f"training RTO {f['training_rto_s']} s (target <= {out['targets']['training_rto_s']:g}), "
          f"RPO {f['rpo_steps_lost']} steps lost (target <= {out['checkpoint_interval_steps']}, one checkpoint "
          f"interval), newest replicated dataset version {f['rpo_dataset_age_s']} s old: {out['verdict']}")
    d = out["dr_store"]
    print(f"DR store across the drill, with {len(d['corrupted_source_checkpoints'])} corrupted source checkpoints "
          f"({d['source_problems_reported']} problems reported, {d['objects_copied']} objects copied): "
          f"{d['objects_before']} objects before, {d['objects_after']} after, {d['lost']} lost, "
          f"{d['overwritten']} overwritten")


if __name__ == "__main__":
    main()
