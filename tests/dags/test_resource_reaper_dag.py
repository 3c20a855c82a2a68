"""The resource_reaper DAG through Airflow (``dag.test``), judging real hybrid_training runs in Airflow's
metadata database through the Task SDK: the gangs of runs that are queued, running, deferred or up
for retry are kept; those of failed, succeeded and deleted runs are released and recorded in the
ledger, with the GPU-hours since the run ended."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from tests.unit.test_config import broken_copy

from hybridflow.reaper.base import Finder, Leftover, Owner

pytestmark = pytest.mark.airflow

# run id -> (DAG run state, state of its train task); "gone" has no DAG run at all.
RUNS = {
    "queued": ("queued", None),
    "running": ("running", "running"),
    "deferred": ("running", "deferred"),
    "up_for_retry": ("running", "up_for_retry"),
    "failed": ("failed", "failed"),
    "success": ("success", "success"),
}


def _ended_at() -> datetime:
    """Three hours before now, taken when the test starts (not when the module is collected, which
    may be minutes earlier in a full run: the gangs' GPU-hours are measured against it)."""
    return datetime.now(UTC).replace(microsecond=0) - timedelta(hours=3)


@pytest.fixture(scope="module")
def airflow_db():
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], env=dict(os.environ), check=True, timeout=300, capture_output=True)


class GangsOfRuns(Finder):
    """One 2-GPU gang of each run's train task, as a cluster's finder would list them."""

    place = "onprem-a"

    def __init__(self, ended_at: datetime) -> None:
        self.released: list[str] = []
        self.ended_at = ended_at

    def find(self, now):
        return [Leftover(self.place, "local-gang", f"train-{run}", owner=Owner("hybrid_training", f"reaper_{run}",
                                                                               "train", 1), gpus=2,
                         since=self.ended_at - timedelta(hours=1)) for run in [*RUNS, "gone"]]

    def release(self, leftover):
        self.released.append(leftover.name)


def _make_runs(ended_at: datetime) -> None:
    """hybrid_training's DAG runs in every state, its train task in the state RUNS gives."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    from airflow.models.dagrun import DagRun
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.utils.session import create_session
    from airflow.utils.types import DagRunTriggeredByType, DagRunType

    from hybridflow.settings import REPO_ROOT

    DagBundlesManager().sync_bundles_to_db()
    sync_bag_to_db(DagBag(dag_folder=str(REPO_ROOT / "dags" / "hybrid_training.py")), "dags-folder", None)
    dag = SerializedDagModel.get_dag("hybrid_training")
    with create_session() as session:
        for i, (run, (run_state, task_state)) in enumerate(RUNS.items()):
            run_id = f"reaper_{run}"
            session.query(DagRun).filter(DagRun.dag_id == "hybrid_training", DagRun.run_id == run_id).delete()
            when = ended_at - timedelta(days=i + 1)
            dr = dag.create_dagrun(run_id=run_id, logical_date=when, data_interval=(when, when), run_after=when,
                                   run_type=DagRunType.MANUAL, triggered_by=DagRunTriggeredByType.TEST,
                                   state=run_state, session=session)
            dr.end_date = ended_at if run_state in ("success", "failed") else None
            dr.get_task_instance("train", session=session).state = task_state


def test_only_gangs_of_ended_runs_are_released_and_recorded(airflow_db, tmp_path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    import hybridflow.reaper.finders as finders
    from hybridflow.reaper.records import last_sweep
    from hybridflow.settings import REPO_ROOT

    def releasing(data):
        data["reaper"] = {"dry_run": True, "clusters": {"onprem-a": {"dry_run": False}}}

    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(broken_copy(tmp_path, "pipeline.yaml", releasing)))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", f"sqlite:///{tmp_path / 'ledger.db'}")
    ended_at = _ended_at()
    gangs = GangsOfRuns(ended_at)
    monkeypatch.setattr(finders, "finders_for", lambda *args, **kw: [gangs])
    _make_runs(ended_at)
    dag = DagBag(dag_folder=str(REPO_ROOT / "dags" / "resource_reaper.py")).get_dag("resource_reaper")
    dag_run = dag.test()
    assert {ti.task_id: ti.state for ti in dag_run.get_task_instances()} == {"sweep": "success", "record": "success"}
    assert sorted(gangs.released) == ["train-failed", "train-gone", "train-success"]

    recorded = last_sweep()
    assert recorded["kept"] == 4 and recorded["released"] == 3 and recorded["errors"] == {}
    hours = {row["name"]: row["gpu_hours"] for row in recorded["rows"]}
    assert hours["train-success"] == pytest.approx(6.0, abs=0.1)  # 2 GPUs x 3 h since the run ended
    assert hours["train-gone"] == pytest.approx(8.0, abs=0.1)  # no end known: since the gang started
