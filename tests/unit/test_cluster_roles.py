"""Cluster roles (primary, elastic, dr): the disaster-recovery pool stays out of normal placement."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from hybridflow.admission import admit
from hybridflow.config import Estate, load_estate
from hybridflow.errors import ConfigError, PlacementError
from hybridflow.placement import PlacementDecision, choose_cluster
from hybridflow.request import AdmittedRun
from hybridflow.settings import REPO_ROOT

SHIPPED = REPO_ROOT / "config"
SPOT = {"interruptible": True, "spot_allowed": True}


def _dr_cluster(**changes) -> dict:
    """A small private DR pool, cheaper than every other cluster so price alone would pick it."""
    cluster = {
        "location": "private", "region": "dc-2", "jurisdiction": "eu", "backend": "local", "role": "dr",
        "dr": {"min_gpus": 2, "peacetime": ["batch"]},
        "node_pools": [{"name": "a100", "gpu_model": "A100-80GB", "gpu_memory_gib": 80, "gpus": 4,
                        "rdma": True, "spot": False}],
        "prices": {"onprem": 0.10},
        "cache": {"conn_id": "hybridflow_dr_west", "bucket": "hf-dr-west"},
    }
    cluster.update(changes)
    return cluster


def _estate(tmp_path: Path, dr: dict | None = None, name: str = "dr-west") -> Estate:
    target = tmp_path / "config"
    shutil.copytree(SHIPPED, target)
    doc = yaml.safe_load((target / "clusters.yaml").read_text())
    doc["clusters"][name] = _dr_cluster() if dr is None else dr
    (target / "clusters.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_estate(target, use_cache=False)


@pytest.fixture
def dr_estate(tmp_path: Path) -> Estate:
    return _estate(tmp_path)


@pytest.fixture
def run_for(seeded_private: Path) -> Callable[..., AdmittedRun]:
    def make(estate: Estate, **params) -> AdmittedRun:
        return admit(params, estate, seeded_private)

    return make


def _candidate(decision: PlacementDecision, name: str) -> dict:
    return next(c for c in decision.candidates if c["cluster"] == name)


def test_shipped_clusters_default_to_primary_and_elastic() -> None:
    estate = load_estate(SHIPPED, use_cache=False)
    assert {n: c.role for n, c in estate.clusters.items()} == {"onprem-a": "primary", "cloud-east": "elastic"}
    assert not any(c.is_dr for c in estate.clusters.values())


@pytest.mark.parametrize("priority", ["normal", "critical"])
def test_dr_cluster_is_never_chosen_outside_peacetime_priorities(dr_estate: Estate, run_for, priority: str) -> None:
    # The primary is full and the DR pool is empty and the cheapest: the run still queues on the primary.
    d = choose_cluster(run_for(dr_estate, priority=priority), dr_estate, {"onprem-a": 4})
    assert d.cluster == "onprem-a"
    dr = _candidate(d, "dr-west")
    assert dr["eligible"] is False
    assert dr["rules"]["role"].startswith("role dr: only batch runs in peacetime")
    assert f"priority={priority}" in dr["rules"]["role"]
    # Even when it is the only cluster left, it is refused with the role named.
    with pytest.raises(PlacementError, match="role dr: only batch runs in peacetime"):
        choose_cluster(run_for(dr_estate, priority=priority), dr_estate, {}, exclude=["onprem-a", "cloud-east"])


def test_peacetime_batch_run_may_land_on_the_dr_pool(dr_estate: Estate, run_for) -> None:
    d = choose_cluster(run_for(dr_estate, priority="batch"), dr_estate, {"onprem-a": 2})
    assert (d.cluster, d.node_pool, d.price_per_gpu_hour) == ("dr-west", "a100", pytest.approx(0.10))
    assert any(r.startswith("role dr: batch runs may use the disaster-recovery pool dr-west") for r in d.reasons)
    assert _candidate(d, "dr-west")["rules"]["role"] == "pass"
    # Only dr clusters carry the role rule; the others keep their rules as before.
    assert "role" not in _candidate(d, "onprem-a")["rules"]


def test_dr_pool_does_not_count_as_private_capacity_for_spilling(dr_estate: Estate, run_for) -> None:
    # 3 of the primary's 4 GPUs in use is past the 70 % spill threshold, however idle the DR pool is.
    d = choose_cluster(run_for(dr_estate, **SPOT), dr_estate, {"onprem-a": 3})
    assert d.cluster == "cloud-east"
    assert any("private clusters 75% in use" in r for r in d.reasons)


def test_peacetime_may_name_several_priorities(tmp_path: Path, run_for) -> None:
    estate = _estate(tmp_path, _dr_cluster(dr={"min_gpus": 4, "peacetime": ["batch", "normal"]}))
    d = choose_cluster(run_for(estate), estate, {"onprem-a": 3})
    assert d.cluster == "dr-west"
    d = choose_cluster(run_for(estate, priority="critical"), estate, {"onprem-a": 3})
    assert d.cluster == "onprem-a"
    assert "only batch runs and normal runs in peacetime" in _candidate(d, "dr-west")["rules"]["role"]


def test_public_dr_cluster_with_a_reason_never_takes_restricted_data(tmp_path: Path, run_for) -> None:
    public = _dr_cluster(location="public", prices={"on_demand": 0.5}, checkpoint_store="cache",
                         cache={"conn_id": "hybridflow_cache_dr", "bucket": "hf-cache-dr"},
                         dr={"min_gpus": 2, "peacetime": ["batch"],
                             "public_reason": "no second data centre; only open data fails over"})
    estate = _estate(tmp_path, public)
    assert estate.clusters["dr-west"].role == "dr"
    d = choose_cluster(run_for(estate, priority="batch", classification="restricted"), estate, {"onprem-a": 4})
    assert d.cluster == "onprem-a"
    assert "restricted" in _candidate(d, "dr-west")["rules"]["sovereignty"]


@pytest.mark.parametrize(
    ("dr", "where", "fragment"),
    [
        (_dr_cluster(role="backup"), "clusters.dr-west.role", "primary"),
        (_dr_cluster(dr={"min_gpus": 9}), "clusters.dr-west.dr.min_gpus", "9 GPUs, but the cluster's node pools hold 4"),
        (_dr_cluster(dr={"min_gpus": -1}), "clusters.dr-west.dr.min_gpus", "greater than 0"),
        (_dr_cluster(dr={"min_gpus": 2, "spare": 1}), "clusters.dr-west.dr.spare", "min_gpus"),
        (_dr_cluster(dr={"min_gpus": 2, "peacetime": ["someday"]}), "clusters.dr-west.dr.peacetime[0]", "batch"),
        (_dr_cluster(dr=None), "clusters.dr-west.dr", "needs dr: {min_gpus: N}"),
        (_dr_cluster(role="primary"), "clusters.dr-west.dr", "only for role: dr"),
        (_dr_cluster(location="public", prices={"on_demand": 0.5}, checkpoint_store="cache",
                     cache={"conn_id": "hybridflow_cache_dr", "bucket": "hf-cache-dr"}),
         "clusters.dr-west.dr.public_reason", "must say why"),
    ],
    ids=["unknown-role", "min-gpus-above-pools", "negative-min-gpus", "unknown-key", "unknown-priority",
         "dr-without-scale", "scale-without-dr", "public-without-reason"],
)
def test_bad_role_config_is_refused_by_name(tmp_path: Path, dr: dict, where: str, fragment: str) -> None:
    if dr.get("dr") is None:
        dr.pop("dr")
    with pytest.raises(ConfigError) as err:
        _estate(tmp_path, dr)
    line = next((ln for ln in str(err.value).splitlines() if f"{where}:" in ln), "")
    assert fragment in line, str(err.value)
