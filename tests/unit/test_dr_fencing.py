"""Declaring a cluster down: the fence, placement in a takeover, draining, failback and bad input."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from hybridflow.admission import AdmittedRun
from hybridflow.config import Estate, load_estate
from hybridflow.dr.fencing import (
    FencingError,
    declare_down,
    declare_up,
    down_clusters,
    fence_status,
    read_fence,
)
from hybridflow.dr.fencing_drain import fence_and_drain
from hybridflow.errors import PlacementError
from hybridflow.placement import PlacementDecision, choose_cluster
from hybridflow.placement.takeover import PlacementHeld, Takeover
from hybridflow.settings import REPO_ROOT

SHIPPED = REPO_ROOT / "config"
REASON = "power loss in dc-1"


def _config(tmp_path: Path, with_dr: bool = True) -> Path:
    target = tmp_path / "config"
    shutil.copytree(SHIPPED, target)
    if with_dr:
        doc = yaml.safe_load((target / "clusters.yaml").read_text())
        doc["clusters"]["dr-west"] = {
            "location": "private", "region": "dc-2", "jurisdiction": "eu", "backend": "local", "role": "dr",
            "dr": {"min_gpus": 2, "peacetime": ["batch"]},
            "node_pools": [{"name": "a100", "gpu_model": "A100-80GB", "gpu_memory_gib": 80, "gpus": 4}],
            "prices": {"onprem": 0.80}, "cache": {"conn_id": "hybridflow_dr_west", "bucket": "hf-dr-west"},
        }
        (target / "clusters.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return target


@pytest.fixture
def estate(tmp_path: Path) -> Estate:
    return load_estate(_config(tmp_path), use_cache=False)


@pytest.fixture
def fence(tmp_path: Path) -> Path:
    return tmp_path / "state" / "fencing.json"


@pytest.fixture
def run_for() -> Callable[..., AdmittedRun]:
    """A run as admission hands it on (placement reads nothing else): the shipped example's project and
    internal data, the Params' defaults unless given."""

    def make(estate: Estate, **params) -> AdmittedRun:
        return AdmittedRun(model="digits", dataset="digits", project="digits-ocr", classification="internal",
                           team="perception", dataset_location="private://datasets/digits", **params)

    return make


def _place(run: AdmittedRun, estate: Estate, fence: Path, used: dict | None = None) -> PlacementDecision:
    return choose_cluster(run, estate, used or {}, takeover=Takeover.of(estate, down_clusters(fence)))


def _candidate(candidates: list[dict], name: str) -> dict:
    return next(c for c in candidates if c["cluster"] == name)


# -- placement while a primary is down ----------------------------------------------------------
def test_a_critical_run_lands_on_the_dr_pool_while_the_primary_is_down(estate: Estate, fence: Path, run_for) -> None:
    run = run_for(estate, priority="critical")
    assert _place(run, estate, fence).cluster == "onprem-a"  # before: the primary, never the DR pool
    declare_down("onprem-a", REASON, by="ops", estate=estate, path=fence)
    d = _place(run, estate, fence)
    # dr.peacetime names only batch; in a takeover the pool serves critical runs all the same.
    assert (d.cluster, d.node_pool) == ("dr-west", "a100")
    assert f"takeover (primary onprem-a declared down: {REASON}): critical runs go to the disaster-recovery pool " \
           "dr-west" in d.reasons
    primary = _candidate(d.candidates, "onprem-a")
    assert not primary["eligible"]
    assert primary["rules"]["fenced"].startswith("declared down at ")
    assert f"by ops: {REASON}; it takes no new placements until `hybridflow cluster up onprem-a`" in \
        primary["rules"]["fenced"]
    assert _candidate(d.candidates, "dr-west")["rules"]["fenced"] == "pass"  # recorded everywhere while one is down


def test_a_normal_run_waits_for_the_primary_and_is_not_placed_on_dr(estate: Estate, fence: Path, run_for) -> None:
    declare_down("onprem-a", REASON, estate=estate, path=fence)
    with pytest.raises(PlacementHeld) as held:
        _place(run_for(estate, priority="normal"), estate, fence)
    err = held.value
    assert (err.state, err.waits_for) == ("waiting", ["onprem-a"])
    assert "it waits for failback (`hybridflow cluster up onprem-a`) or for capacity elsewhere" in err.reason
    assert "normal runs are not placed on the disaster-recovery pool" in err.reason
    assert str(err).startswith("waiting: onprem-a would take the run but is declared down")
    dr = _candidate(err.candidates, "dr-west")
    assert not dr["eligible"]
    assert "normal runs are not placed there, they wait for the primary" in dr["rules"]["role"]
    assert isinstance(err, PlacementError)  # the placement step refuses it like any run no cluster takes now


def test_a_batch_run_is_paused_everywhere_during_a_takeover(estate: Estate, fence: Path, run_for) -> None:
    run = run_for(estate, priority="batch", interruptible=True, spot_allowed=True)
    assert _place(run, estate, fence, {"onprem-a": 4}).cluster == "cloud-east"  # peacetime: spills to spot
    declare_down("onprem-a", REASON, estate=estate, path=fence)
    with pytest.raises(PlacementHeld) as held:
        _place(run, estate, fence, {"onprem-a": 4})
    err = held.value
    assert err.state == "paused"
    assert err.reason == (f"estate in takeover (primary onprem-a declared down: {REASON}): batch runs are paused "
                          "until failback (`hybridflow cluster up onprem-a`)")
    # cloud-east's spot pool would take it otherwise: every cluster records the pause.
    assert all(c["rules"]["takeover"] == err.reason for c in err.candidates)
    assert _candidate(err.candidates, "cloud-east")["rules"]["spot"] == "pass"


def test_a_down_elastic_cluster_takes_no_new_placements_and_is_no_takeover(estate: Estate, fence: Path,
                                                                           run_for) -> None:
    spot = {"interruptible": True, "spot_allowed": True}
    assert _place(run_for(estate, **spot), estate, fence, {"onprem-a": 4}).cluster == "cloud-east"  # spill
    declare_down("cloud-east", "region outage", estate=estate, path=fence)
    d = _place(run_for(estate, **spot), estate, fence, {"onprem-a": 4})
    assert d.cluster == "onprem-a"  # queues on the busy primary instead
    assert "region outage" in _candidate(d.candidates, "cloud-east")["rules"]["fenced"]
    assert "takeover" not in _candidate(d.candidates, "cloud-east")["rules"]  # a primary is up: no takeover
    assert _candidate(d.candidates, "dr-west")["rules"]["role"].startswith("role dr: only batch runs in peacetime")
    with pytest.raises(PlacementHeld, match="waiting: cloud-east would take the run but is declared down"):
        _place(run_for(estate, cluster_preference="public", **spot), estate, fence)


def test_up_restores_normal_placement(estate: Estate, fence: Path, run_for) -> None:
    declare_down("onprem-a", REASON, estate=estate, path=fence)
    change = declare_up("onprem-a", by="ops", estate=estate, path=fence)
    assert change.changed and change.record["down_reason"] == REASON
    assert "serving returns to the cluster only through a deploy" in change.record["serving"]
    for priority in ("critical", "normal"):
        d = _place(run_for(estate, priority=priority), estate, fence)
        assert d.cluster == "onprem-a"
        assert "fenced" not in _candidate(d.candidates, "onprem-a")["rules"]
    assert _place(run_for(estate, priority="batch"), estate, fence, {"onprem-a": 4}).cluster == "dr-west"
    assert [e["event"] for e in read_fence(fence)["history"]] == ["down", "up"]
    assert down_clusters(fence) == {}


# -- the fence itself ---------------------------------------------------------------------------
def test_declaring_twice_changes_nothing_the_second_time(estate: Estate, fence: Path) -> None:
    first = declare_down("onprem-a", REASON, by="ops", estate=estate, path=fence)
    written = fence.read_bytes()
    again = declare_down("onprem-a", "another reason", by="someone else", estate=estate, path=fence)
    assert first.changed and not again.changed
    assert again.record == first.record  # who, when and why of the first declaration stand
    assert fence.read_bytes() == written
    declare_up("onprem-a", estate=estate, path=fence)
    written = fence.read_bytes()
    assert not declare_up("onprem-a", estate=estate, path=fence).changed
    assert fence.read_bytes() == written


@pytest.mark.parametrize(
    ("cluster", "reason", "fragment"),
    [
        ("nowhere", REASON, "cluster 'nowhere' is not in clusters.yaml; use one of: cloud-east, onprem-a"),
        ("dr-west", REASON, "cluster 'dr-west' is the disaster-recovery pool (role: dr)"),
        ("onprem-a", "  ", "reason is empty: say why the cluster is declared down (--reason)"),
    ],
    ids=["unknown-cluster", "the-dr-cluster", "empty-reason"],
)
def test_bad_input_is_refused_by_name_and_changes_nothing(estate: Estate, fence: Path, cluster: str, reason: str,
                                                          fragment: str) -> None:
    declare_down("cloud-east", "region outage", estate=estate, path=fence)
    before = fence.read_bytes()
    with pytest.raises(FencingError) as err:
        declare_down(cluster, reason, estate=estate, path=fence)
    assert fragment in str(err.value)
    assert fence.read_bytes() == before


def test_no_dr_cluster_configured_is_refused_and_nothing_is_written(tmp_path: Path, fence: Path) -> None:
    shipped = load_estate(_config(tmp_path, with_dr=False), use_cache=False)
    with pytest.raises(FencingError, match="no cluster in clusters.yaml has role: dr, so nothing would take over"):
        declare_down("onprem-a", REASON, estate=shipped, path=fence)
    assert not fence.exists()


# -- draining, and the command ------------------------------------------------------------------
class _Backend:
    def __init__(self, gangs: list[str], fail: Exception | None = None) -> None:
        self.gangs, self.fail, self.stopped = gangs, fail, []

    def find_gangs(self, labels, *, not_labels=None) -> list[str]:
        if self.fail:
            raise self.fail
        return list(self.gangs)

    def stop(self, name: str, reason: str) -> bool:
        self.stopped.append((name, reason))
        return True


def test_down_checkpoints_the_cluster_s_gangs_once_and_keeps_the_outcome(estate: Estate, tmp_path: Path) -> None:
    backend = _Backend(["train-a", "train-b"])
    out = fence_and_drain("onprem-a", REASON, estate=estate, state_dir=tmp_path / "state",
                          backend_factory=lambda *_: backend)
    assert backend.stopped == [(g, f"cluster onprem-a declared down: {REASON}") for g in ("train-a", "train-b")]
    drain = down_clusters(tmp_path / "state" / "fencing.json")["onprem-a"]["drain"]
    assert drain == out["record"]["drain"]
    assert drain["gangs"] == {"answered": True, "stopped": ["train-a", "train-b"], "gone": []}
    assert drain["serving"]["entry"] is None and "serving.target local" in drain["serving"]["note"]
    again = fence_and_drain("onprem-a", REASON, estate=estate, state_dir=tmp_path / "state",
                            backend_factory=lambda *_: backend)
    assert not again["changed"] and len(backend.stopped) == 2


def test_a_cluster_that_does_not_answer_is_fenced_all_the_same(estate: Estate, tmp_path: Path) -> None:
    out = fence_and_drain("onprem-a", REASON, estate=estate, state_dir=tmp_path / "state",
                          backend_factory=lambda *_: _Backend([], fail=ConnectionError("no route to host")))
    assert out["changed"]
    assert out["record"]["drain"]["gangs"] == {"answered": False, "error": "ConnectionError: no route to host",
                                               "stopped": [], "gone": []}
    assert "onprem-a" in down_clusters(tmp_path / "state" / "fencing.json")


def test_the_command_fences_places_and_fails_back(tmp_path: Path, monkeypatch, capsys, run_for) -> None:
    from hybridflow.backends.base import ClusterLoad
    from hybridflow.cli import main
    from hybridflow.placement import place

    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(_config(tmp_path)))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    assert main(["cluster", "down", "nowhere", "--reason", REASON]) == 2
    assert "hybridflow cluster down: cluster 'nowhere' is not in clusters.yaml" in capsys.readouterr().err
    assert main(["cluster", "down", "onprem-a"]) == 2
    assert "reason is empty" in capsys.readouterr().err
    assert main(["cluster", "up", "nowhere"]) == 2
    assert "use one of: cloud-east, dr-west, onprem-a" in capsys.readouterr().err
    assert not (tmp_path / "home" / "state" / "fencing.json").exists()

    assert main(["cluster", "down", "onprem-a", "--reason", REASON, "--by", "ops"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["changed"] and out["record"]["drain"]["gangs"] == {"answered": True, "stopped": [], "gone": []}
    assert main(["cluster", "status"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["takeover"] and status["clusters"]["onprem-a"]["state"] == "down"
    assert status == fence_status(path=tmp_path / "home" / "state" / "fencing.json")

    estate = load_estate(tmp_path / "config", use_cache=False)
    loads = {n: ClusterLoad(n, c.total_gpus) for n, c in estate.clusters.items()}
    assert place(run_for(estate, priority="critical"), estate, loads).cluster == "dr-west"  # read from the fence
    assert main(["cluster", "up", "onprem-a"]) == 0
    assert json.loads(capsys.readouterr().out)["changed"]
    assert place(run_for(estate, priority="critical"), estate, loads).cluster == "onprem-a"


def test_the_dag_s_task_declares_as_the_triggering_user_and_fails_bad_params(tmp_path: Path, monkeypatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from hybridflow.dr.fencing_task import fence_task

    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(_config(tmp_path)))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    path = tmp_path / "home" / "state" / "fencing.json"
    for params, fragment in [({"action": "down", "cluster": "dr-west", "reason": REASON}, "disaster-recovery pool"),
                             ({"action": "down", "cluster": None, "reason": REASON}, "cluster: empty"),
                             ({"action": "down", "cluster": "onprem-a", "reason": None}, "reason is empty")]:
        with pytest.raises(AirflowFailException, match=fragment):
            fence_task(params, by="alice")
    assert not path.exists()
    out = fence_task({"action": "down", "cluster": "onprem-a", "reason": REASON}, by="alice")
    assert out["changed"] and down_clusters(path)["onprem-a"]["by"] == "alice"
    assert fence_task({"action": "up", "cluster": "onprem-a"}, by="alice")["record"]["by"] == "alice"
    assert down_clusters(path) == {}
