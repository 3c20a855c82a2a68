"""Making room on the embedded default, with real processes: a restricted run waiting behind an
interruptible run that may run public, on the full private pool, starts once that gang is checkpointed
and moved; the moved run resumes on the public pool from its checkpoint, its record saying why."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from tests.integration.test_bring_your_own import TRAINING_FNS, _edit_yaml, _estate
from tests.support.train_task import train_task

from hybridflow.backends.local import LocalSlotPool


def _paced_model(config: Path) -> None:
    def register(body: dict) -> None:
        body["models"]["paced"] = {**body["models"]["digits-mlp"], "entrypoint": "contract_fns:paced"}
        body["models"]["paced"].pop("serving")
    _edit_yaml(config / "models.yaml", register)

    def quick(body: dict) -> None:
        body["training"].update(gang_admission_timeout_s=60, interruptible_checkpoint_every_s=1, preemption_grace_s=10)
    _edit_yaml(config / "pipeline.yaml", quick)


def test_a_restricted_run_moves_an_interruptible_gang_off_the_full_private_pool(tmp_path, monkeypatch, rclone_s3):
    from hybridflow.devenv.rclone import airflow_conn_uri

    endpoint, access, secret, data_dir = rclone_s3
    (data_dir / "hf-cache-cloud-east").mkdir(exist_ok=True)
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_CACHE_CLOUD_EAST", airflow_conn_uri(access, secret, endpoint))
    home = _estate(tmp_path, monkeypatch, _paced_model)
    monkeypatch.syspath_prepend(str(TRAINING_FNS))
    monkeypatch.setenv("PYTHONPATH", str(TRAINING_FNS))

    moving_run, placement, _, moving, context = train_task("movable", {
        "model": "paced", "workers": 4, "interruptible": True, "spot_allowed": True,
        "hyperparameters": {"steps": 400}, "checkpoint_every_steps": 25})
    assert placement["cluster"] == "onprem-a"  # the private pool is empty: private first
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=moving.execute(context)), daemon=True)
    thread.start()
    pool, gang = LocalSlotPool(home / "state", "onprem-a", 4), f"train-{moving_run['run_key']}"
    deadline = time.monotonic() + 60
    while gang not in pool.holdings() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pool.holdings()[gang]["movable"] is True and pool.usage() == 4
    checkpoints = home / "private" / "checkpoints" / moving_run["run_key"]
    while not list(checkpoints.glob("step-*/MANIFEST*")) and time.monotonic() < deadline + 120:
        time.sleep(0.2)  # it trains and commits a checkpoint (its workers start slowly on a busy machine)
    assert list(checkpoints.glob("step-*/MANIFEST*"))

    restricted_run, where, _, restricted, rcontext = train_task("restricted", {
        "model": "breast-cancer", "workers": 2, "hyperparameters": {"steps": 20}})
    assert where["cluster"] == "onprem-a" and restricted_run["classification"] == "restricted"
    # Admitted within its admission window: otherwise the task would have deferred to wait in the queue.
    assert restricted.execute(rcontext)["cluster"] == "onprem-a"

    thread.join(timeout=180)
    assert not thread.is_alive() and out["result"]["cluster"] == "cloud-east"
    folder = home / "private" / "runs" / moving_run["run_key"]
    attempts = json.loads((folder / "train-attempts.json").read_text())
    assert [(a["cluster"], a["outcome"]) for a in attempts] == [("onprem-a", "moved"), ("cloud-east", "succeeded")]
    assert "making room on onprem-a for gang train-" in attempts[0]["reason"]
    assert attempts[1]["start_step"] >= attempts[0]["last_committed_step"] > 0  # resumed from its checkpoint
    assert out["result"]["final_step"] == 400
    shown = json.loads((folder / "placement.json").read_text())
    assert shown["failovers"][0]["cluster"] == "onprem-a" and "making room" in shown["failovers"][0]["reason"]
