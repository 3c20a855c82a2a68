"""Who may trigger the DR DAGs: ``cluster_fence`` (declare a cluster down or up) and ``dr_drill``
grant triggering to the DR operator role alone, through their ``access_control`` as the dag
processor hands it to the FAB auth manager's per-DAG permission sync (docs/dr-fencing.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.airflow

DAGS = Path(__file__).resolve().parents[2] / "dags"
DR_DAGS = ("cluster_fence", "dr_drill")


@pytest.fixture(scope="module")
def synced_access() -> dict[str, dict]:
    """Each DR DAG's access_control as the dag processor reads it from the serialized DAG."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization, LazyDeserializedDAG

    bag = DagBag(dag_folder=str(DAGS))
    return {d: LazyDeserializedDAG(data=DagSerialization.to_dict(bag.dags[d])).access_control or {} for d in DR_DAGS}


def _may_trigger(access: dict, role: str) -> bool:
    """Triggering a run needs edit on the DAG and create on its runs (the FAB auth manager's check)."""
    perms = access.get(role) or {}
    return "can_edit" in perms.get("DAGs", set()) and "can_create" in perms.get("DAG Runs", set())


@pytest.mark.parametrize("dag_id", DR_DAGS)
def test_only_the_dr_operator_role_is_granted_the_trigger(synced_access, dag_id):
    from hybridflow.dr.fencing.task import DR_OPERATOR_ROLE

    access = synced_access[dag_id]
    assert DR_OPERATOR_ROLE == "DR operator"
    assert _may_trigger(access, "DR operator"), f"{dag_id} does not grant the DR operator role its trigger"
    for role in ("User", "Op", "Viewer", "ml-platform"):
        assert not _may_trigger(access, role), f"{dag_id} grants {role} its trigger"
    assert set(access) == {"DR operator"}, f"{dag_id} grants roles other than the DR operator: {sorted(access)}"
    # It may read what it declared: the run and its log.
    assert "can_read" in access["DR operator"]["DAGs"] and "can_read" in access["DR operator"]["DAG Runs"]
