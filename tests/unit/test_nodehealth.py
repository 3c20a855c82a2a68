"""Node health: Xid/ECC/probe findings become cordons, taints and gang restarts on Kubernetes
clusters (through the provider's hook, against the cluster simulator) and records on local ones."""

from __future__ import annotations

import copy
import json

import kubernetes_validate
import pytest
from tests.support.k8s_sim import SimCluster, install

from hybridflow.backends.k8s.manifests import GANG_LABEL
from hybridflow.backends.k8s.nodes import TAINT_KEY, node_cordon_patch
from hybridflow.config import load_estate
from hybridflow.nodehealth import (
    NodeFinding,
    clear_node,
    read_state,
    report_findings,
    restore_node,
)
from hybridflow.settings import REPO_ROOT


class _Estate:
    """The repository's estate with one cluster switched to the kubernetes backend."""

    def __init__(self) -> None:
        real = load_estate(REPO_ROOT / "config")
        gpu = real.clusters["cloud-east"].model_copy(update={"backend": "kubernetes", "conn_id": "k8s_east",
                                                              "scheduler": "volcano"})
        gpu._name = "cloud-east"
        self.clusters = {**real.clusters, "cloud-east": gpu}


def _ok(node: str, cluster: str = "cloud-east", **kw) -> NodeFinding:
    return NodeFinding(cluster, node, kw.get("xid", ()), kw.get("sbe", 0), kw.get("dbe", 0), kw.get("probe", True))


@pytest.fixture
def sim(monkeypatch):
    sim = SimCluster({"gpu-1": {"gpus": 4, "labels": {"pool": "h100"}},
                      "gpu-2": {"gpus": 4, "labels": {"pool": "h100"},
                                "taints": [{"key": "dedicated", "value": "ml", "effect": "NoExecute"}]}})
    install(monkeypatch, sim)
    return sim


@pytest.fixture
def report(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_K8S_EAST", "kubernetes://")
    estate = _Estate()
    path = tmp_path / "nodehealth.json"
    return lambda findings: report_findings(findings, estate=estate, state_path=path), path


def _gang_pod(sim, name: str, node: str, gang: str) -> None:
    template = {"metadata": {"labels": {GANG_LABEL: gang}},
                "spec": {"containers": [{"name": "trainer", "image": "trainer:1",
                                        "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
    sim._new_pod("hybridflow", name, template, node, ("vcjob", "hybridflow", gang), {})
    sim.pods[("hybridflow", name)]["phase"] = "Running"


def test_one_failed_probe_is_a_blip_and_two_in_a_row_cordon(sim, report):
    run, path = report
    first = run([_ok("gpu-1", probe=False)])
    assert not first[0].unhealthy and first[0].probe_fail_streak == 1
    assert not sim.nodes["gpu-1"]["unschedulable"] and "patch node gpu-1" not in sim.calls
    # An answered probe in between resets the streak: two failures must be consecutive.
    run([_ok("gpu-1")])
    again = run([_ok("gpu-1", probe=False)])
    assert not again[0].unhealthy and again[0].probe_fail_streak == 1
    second = run([_ok("gpu-1", probe=False)])
    assert second[0].unhealthy and second[0].reason == "probe-failed"
    assert sim.nodes["gpu-1"]["unschedulable"]
    assert {"key": TAINT_KEY, "value": "probe-failed", "effect": "NoSchedule"} in sim.nodes["gpu-1"]["taints"]
    assert read_state(path)["cloud-east"]["gpu-1"]["actioned"]


def test_xid_cordons_at_once_keeps_other_taints_and_restarts_only_gangs_on_the_node(sim, report):
    run, _ = report
    _gang_pod(sim, "train-a-master-0", "gpu-2", "train-a")
    _gang_pod(sim, "train-a-worker-0", "gpu-1", "train-a")  # same gang, healthy node: restarted too
    _gang_pod(sim, "train-b-master-0", "gpu-1", "train-b")
    [decision] = run([_ok("gpu-2", xid=(79,))])
    assert decision.unhealthy and decision.newly_unhealthy and decision.reason == "xid-79"
    node = sim.nodes["gpu-2"]
    assert node["unschedulable"]
    assert {t["key"] for t in node["taints"]} == {"dedicated", TAINT_KEY}
    assert sim.pod_names("train-a") == [] and sim.pod_names("train-b") == ["train-b-master-0"]
    assert any("restarted gang train-a (2 pods deleted)" in a for a in decision.actions)
    # Already unhealthy: the next pass does not act again.
    calls = len(sim.calls)
    [later] = run([_ok("gpu-2", xid=(79,))])
    assert later.unhealthy and not later.newly_unhealthy and len(sim.calls) == calls


def test_restored_node_is_uncordoned_keeps_other_taints_and_is_judged_afresh(sim, report):
    run, path = report
    run([_ok("gpu-2", dbe=1)])
    assert sim.nodes["gpu-2"]["unschedulable"]
    done = restore_node("cloud-east", "gpu-2", estate=_Estate(), state_path=path)
    node = sim.nodes["gpu-2"]
    assert not node["unschedulable"] and [t["key"] for t in node["taints"]] == ["dedicated"]
    assert done[0] == "uncordoned gpu-2" and "cleared the unhealthy mark of cloud-east/gpu-2" in done
    assert "gpu-2" not in read_state(path)["cloud-east"]
    # Healthy now: nothing happens; a new fault cordons it again at once.
    assert not run([_ok("gpu-2")])[0].unhealthy and not node["unschedulable"]
    assert run([_ok("gpu-2", xid=(48,))])[0].newly_unhealthy and node["unschedulable"]
    with pytest.raises(ValueError, match="'nowhere' is not in clusters.yaml"):
        restore_node("nowhere", "gpu-2", estate=_Estate(), state_path=path)


def test_uncorrectable_ecc_cordons_but_correctable_does_not(sim, report):
    run, _ = report
    decisions = run([_ok("gpu-1", sbe=12), _ok("gpu-2", dbe=1)])
    assert [d.unhealthy for d in decisions] == [False, True]
    assert decisions[1].reason == "ecc-dbe"
    assert not sim.nodes["gpu-1"]["unschedulable"] and sim.nodes["gpu-2"]["unschedulable"]


def test_local_cluster_records_the_decision_only(tmp_path, sim, report):
    run, path = report
    [decision] = run([_ok("local-node", cluster="onprem-a", xid=(48,))])
    assert decision.unhealthy and decision.actions == ("recorded",)
    assert not any("patch" in c for c in sim.calls)
    state = read_state(path)["onprem-a"]["local-node"]
    assert state["unhealthy"] and state["reason"] == "xid-48" and state["since"]
    assert clear_node("onprem-a", "local-node", state_path=path)
    assert "local-node" not in read_state(path)["onprem-a"]


def test_api_failure_is_retried_on_the_next_pass(sim, report, monkeypatch):
    run, path = report
    broken = copy.copy(sim.core)

    def down(**kwargs):
        raise ConnectionError("API server unreachable")

    broken.read_node = down
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    monkeypatch.setattr(KubernetesHook, "core_v1_client", property(lambda self: broken))
    [first] = run([_ok("gpu-1", xid=(31,))])
    assert first.unhealthy and first.actions == () and not read_state(path)["cloud-east"]["gpu-1"]["actioned"]
    monkeypatch.setattr(KubernetesHook, "core_v1_client", property(lambda self: sim.core))
    [second] = run([_ok("gpu-1")])  # healthy reading now, but the node stays marked until cleared
    assert second.unhealthy and sim.nodes["gpu-1"]["unschedulable"]


def test_cordon_patch_is_a_valid_node():
    patch = node_cordon_patch("gpu-1", "xid-79", [{"key": "dedicated", "value": "ml", "effect": "NoExecute"}])
    kubernetes_validate.validate(patch, "1.33", strict=True)
    assert patch["spec"]["taints"][-1] == {"key": TAINT_KEY, "value": "xid-79", "effect": "NoSchedule"}


def test_node_command_lists_and_restores_a_local_node(tmp_path, monkeypatch, capsys):
    from hybridflow.cli import main

    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path))
    report_findings([_ok("slot-host", cluster="onprem-a", xid=(79,))], estate=load_estate(REPO_ROOT / "config"))
    assert main(["node", "list"]) == 0
    assert json.loads(capsys.readouterr().out)["onprem-a"]["slot-host"]["reason"] == "xid-79"
    assert main(["node", "restore", "onprem-a", "slot-host"]) == 0
    assert "cleared the unhealthy mark of onprem-a/slot-host" in capsys.readouterr().out
    assert main(["node", "list"]) == 0 and json.loads(capsys.readouterr().out) == {"onprem-a": {}}
    assert main(["node", "restore"]) == 2 and "needs the cluster and the node" in capsys.readouterr().err
    assert main(["node", "restore", "mars", "n1"]) == 2 and "'mars' is not in clusters.yaml" in capsys.readouterr().err


def test_xids_an_exporter_counted_in_its_window_cordon_the_node(sim, report):
    from datetime import UTC, datetime
    from pathlib import Path

    from hybridflow.metering.collect import node_findings
    from hybridflow.metering.dcgm import read_page

    page_file = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm-exporter-written" / "t400_xid-errors-active.prom"
    page = read_page(page_file.read_text().replace('Hostname="workstation"', 'Hostname="gpu-2"'),
                     cluster="cloud-east", ts=datetime(2026, 5, 1, 12, 5, tzinfo=UTC))
    assert [s.xid for s in page.samples] == [None]  # no classic Xid gauge on this page: the count alone
    run, path = report
    [decision] = run(node_findings(page.samples, xid_counts=page.xid_counts))
    assert decision.unhealthy and decision.newly_unhealthy and decision.reason == "xid-42"
    assert sim.nodes["gpu-2"]["unschedulable"] and not sim.nodes["gpu-1"].get("unschedulable")
    assert "Xid 42 x1 on GPU-b9f9e81b-bee7-34bc-af17-132ef6592740 within 300 s" in read_state(path)["cloud-east"]["gpu-2"]["last"]["detail"]
