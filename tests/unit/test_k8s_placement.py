"""Placement sees Kubernetes clusters: the spill threshold, team caps and reachability work on the
load the cluster's gang scheduler reports (the simulator's Volcano queues and PodGroups), read by the
pipeline's own step through KubernetesHook."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from tests.support.k8s_config import as_kubernetes
from tests.support.k8s_sim import SimCluster, install

from hybridflow import pipeline
from hybridflow.backends.base import GangJob
from hybridflow.backends.k8s import load as load_module
from hybridflow.backends.k8s.backend import KubernetesGangBackend
from hybridflow.config import load_estate
from hybridflow.errors import AdmissionError
from hybridflow.runs import RunIdentity
from hybridflow.settings import REPO_ROOT, get_settings

K8S = "k8s-dc2"
SPOT = {"interruptible": True, "spot_allowed": True}


@pytest.fixture
def estate(tmp_path, monkeypatch, seeded_private):
    """The shipped config with k8s-dc2, a cheaper private Volcano cluster of 4 A100s, instead of onprem-a."""
    from tests.conftest import copy_seeded

    home, config = tmp_path / "home", tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", config)
    copy_seeded(seeded_private, home / "private")
    clusters = yaml.safe_load((config / "clusters.yaml").read_text())
    dc2 = json.loads(json.dumps(clusters["clusters"].pop("onprem-a")))
    dc2["node_pools"][0]["node_labels"] = {"hybridflow.io/pool": "a100"}
    clusters["clusters"][K8S] = as_kubernetes(dc2, conn_id="k8s_dc2", scheduler="volcano")
    (config / "clusters.yaml").write_text(yaml.safe_dump(clusters, sort_keys=False))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(home))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
    monkeypatch.setenv("AIRFLOW_CONN_K8S_DC2", "kubernetes://")
    sim = SimCluster({f"gpu-{i}": {"gpus": 2, "labels": {"hybridflow.io/pool": "a100"}} for i in (1, 2)})
    for queue in ("perception", "search", "research"):
        sim.add_volcano_queue(queue)
    install(monkeypatch, sim)
    load_module.clear_cache()
    yield sim
    load_module.clear_cache()


def _occupy(sim: SimCluster, gpus: int, queue: str, team: str, run: str = "other") -> str:
    """A gang of ``gpus`` running in ``queue`` (another tenant's, or a team's earlier run)."""
    estate = load_estate(get_settings().config_dir, use_cache=False)
    backend = KubernetesGangBackend(estate.clusters[K8S], image="img")
    job = GangJob(name=f"train-{run}", workers=gpus, spec={"run_key": run},
                  labels={"project": "p", "team": team, "priority": "normal"})
    backend.submit_spec(backend.gang_spec(job, pool="a100", queue=queue))
    sim.run(3)
    load_module.clear_cache()
    return job.name


def _place(params: dict, name: str = "r") -> dict:
    run = pipeline.admit(params, RunIdentity("hybrid_training", f"manual__{name}"))
    return pipeline.choose_cluster(run)


def test_spill_threshold_moves_runs_to_public_when_the_kubernetes_private_cluster_is_busy(estate) -> None:
    assert _place(SPOT, "idle")["cluster"] == K8S  # idle private cluster: private first
    _occupy(estate, 3, "research", "research")  # another tenant holds 3 of its 4 GPUs: 75 % >= 70 %
    placement = _place(SPOT, "busy")
    assert placement["cluster"] == "cloud-east"
    assert any("75% in use or queued (>= spill threshold 70%)" in r for r in placement["reasons"])
    dc2 = next(c for c in placement["candidates"] if c["cluster"] == K8S)
    assert dc2["load"] == 0.75 and dc2["eligible"]


def test_a_team_over_its_cap_on_kubernetes_is_refused_when_the_config_says_refuse(estate, monkeypatch) -> None:
    config = Path(get_settings().config_dir)
    doc = yaml.safe_load((config / "pipeline.yaml").read_text())
    doc["admission"]["over_team_cap"] = "refuse"
    (config / "pipeline.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    projects = yaml.safe_load((config / "projects.yaml").read_text())
    projects["teams"]["perception"]["gpu_cap"] = 3
    (config / "projects.yaml").write_text(yaml.safe_dump(projects, sort_keys=False))
    assert _place({"workers": 2}, "first")  # nothing held yet: within the cap
    _occupy(estate, 2, "perception", "perception")  # the team's queue on the cluster holds 2 GPUs
    with pytest.raises(AdmissionError) as err:
        pipeline.admit({"workers": 2}, RunIdentity("hybrid_training", "manual__second"))
    assert err.value.field == "priority" or "gpu_cap" in str(err.value)
    assert "holds 2 of its gpu_cap of 3 GPUs" in str(err.value)


def test_an_unreachable_kubernetes_cluster_is_never_chosen_and_the_explanation_says_why(estate) -> None:
    estate.unreachable = True
    placement = _place(SPOT, "dark")
    assert placement["cluster"] == "cloud-east"  # the cheaper private cluster cannot be read
    dc2 = next(c for c in placement["candidates"] if c["cluster"] == K8S)
    assert not dc2["eligible"] and "Connection k8s_dc2" in dc2["rules"]["reachable"]
    with pytest.raises(AdmissionError, match=r"cluster k8s-dc2 \(Connection k8s_dc2\): connection refused at sim\.invalid:6443"):
        _place({"classification": "restricted"}, "dark-restricted")  # nowhere else to go: said at admit


def test_a_missing_team_queue_is_said_at_placement_before_anything_runs(estate) -> None:
    projects_path = Path(get_settings().config_dir) / "projects.yaml"
    projects = yaml.safe_load(projects_path.read_text())
    projects["teams"]["perception"]["queue"] = "no-such-queue"
    projects_path.write_text(yaml.safe_dump(projects, sort_keys=False))
    with pytest.raises(Exception, match="queue 'no-such-queue' does not exist on the cluster.*teams.perception.queue"):
        _place({"classification": "restricted"}, "noqueue")
    assert not estate.vcjobs  # nothing was submitted
