"""Stand-ins for the reaper's view of Airflow: each run's verdict given by the test, and the owner
annotations a train task's gang carries."""

from __future__ import annotations

from hybridflow.reaper.states import Judgement


class RunStates:
    """Judges an owner by its run id: ``verdicts`` maps run ids to ALIVE / ENDED."""

    def __init__(self, verdicts):
        self.verdicts = verdicts

    def judge(self, owner):
        return Judgement(self.verdicts[owner.run_id], None, owner.run_id)


def train_owner(run_id: str) -> dict[str, str]:
    """The owner of hybrid_training's train task in run ``run_id`` (first try)."""
    return {"dag_id": "hybrid_training", "run_id": run_id, "task_id": "train", "try_number": "1"}
