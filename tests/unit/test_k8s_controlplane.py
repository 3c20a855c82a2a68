"""The local control plane's failures, with stand-in binaries (no Go build): a port in use, a
component that exits while starting, one that never gets ready; each stops with a message naming
the cause and the fix, and leaves no process behind. Plus the node agent's fieldRef resolution and
the fake nodes made from a cluster's pools."""

from __future__ import annotations

import os
import socket
import stat
import sys
import time
from types import SimpleNamespace

import pytest

from hybridflow.devenv.k8s import build
from hybridflow.devenv.k8s.agent import _field
from hybridflow.devenv.k8s.controlplane import ControlPlane
from hybridflow.devenv.k8s.nodes import GPU, KWOK_ANNOTATION, pool_nodes
from hybridflow.devenv.k8s.processes import ControlPlaneError, free_port, runs


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """Every binary present in a cache of their own, as Python scripts (a shell might exec its last
    command, and the process would no longer show the script): ``put(name, body)`` writes one."""
    monkeypatch.setenv("HYBRIDFLOW_K8S_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HYBRIDFLOW_K8S_READY_TIMEOUT_S", "3")
    paths = build.binaries()

    def put(name: str, body: str) -> None:
        path = paths[name]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!{sys.executable}\nimport sys, time\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)

    for name in paths:
        put(name, "time.sleep(600)")
    return SimpleNamespace(put=put, paths=paths)


def _ours(paths) -> list[int]:
    """Pids of processes running one of the stand-ins."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and any(runs(int(entry), str(p)) for p in paths.values()):
            found.append(int(entry))
    return found


def test_a_port_in_use_is_refused_naming_it_and_the_fix_before_anything_starts(tmp_path, stand_ins):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ControlPlaneError, match=rf"port {port} on 127.0.0.1 is in use.*--port"):
            ControlPlane(tmp_path / "plane", port=port, addons=()).up([])
    assert _ours(stand_ins.paths) == []


def test_a_component_that_exits_while_starting_is_named_with_its_log(tmp_path, stand_ins):
    stand_ins.put("etcd", "sys.exit('etcdmain: listen tcp 127.0.0.1:1: bind: permission denied')")
    with pytest.raises(ControlPlaneError, match=r"(?s)etcd exited while starting.*bind: permission denied"):
        ControlPlane(tmp_path / "plane", port=free_port(), addons=()).up([])
    assert _ours(stand_ins.paths) == []


def test_a_component_that_never_gets_ready_times_out_and_leaves_no_process(tmp_path, stand_ins):
    plane = ControlPlane(tmp_path / "plane", port=free_port(), addons=())
    started = time.monotonic()
    with pytest.raises(ControlPlaneError, match=r"(?s)etcd did not get ready within 3 s.*HYBRIDFLOW_K8S_READY_TIMEOUT_S"):
        plane.up([])
    assert time.monotonic() - started < 30
    assert _ours(stand_ins.paths) == []  # the sleeping stand-in was stopped
    assert not plane.state_path.exists() and not plane.running()


def test_an_unknown_addon_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ControlPlaneError, match=r"unknown addon\(s\) \['kubeflow'\]; choose from"):
        ControlPlane(tmp_path, addons=("kueue", "kubeflow"))


def test_nodes_of_a_pool_carry_its_labels_gpus_and_the_gpu_taint():
    nodes = pool_nodes("dc2-k8s", [{"name": "h100", "gpus": 12, "node_labels": {"nvidia.com/gpu.product": "H100"}}],
                       gpus_per_node=8)
    assert [(n.name, n.gpus) for n in nodes] == [("h100-0", 8), ("h100-1", 4)]
    manifest = nodes[1].manifest()
    assert manifest["metadata"]["labels"]["nvidia.com/gpu.product"] == "H100"
    assert manifest["metadata"]["annotations"][KWOK_ANNOTATION] == "fake"
    assert manifest["spec"]["taints"] == [{"key": GPU, "value": "present", "effect": "NoSchedule"}]
    assert nodes[1].capacity()[GPU] == "4"
    with pytest.raises(ValueError, match="gpus_per_node must be at least 1"):
        pool_nodes("x", [], gpus_per_node=0)


def test_the_node_agent_resolves_field_refs_as_a_kubelet_does():
    pod = SimpleNamespace(
        metadata=SimpleNamespace(name="g-0-abc", namespace="ml", uid="u1",
                                 annotations={"batch.kubernetes.io/job-completion-index": "3"}, labels={"a": "b"}),
        spec=SimpleNamespace(node_name="run-0"))
    assert _field(pod, "metadata.annotations['batch.kubernetes.io/job-completion-index']") == "3"
    assert (_field(pod, "metadata.name"), _field(pod, "metadata.labels['a']"), _field(pod, "spec.nodeName")) == (
        "g-0-abc", "b", "run-0")
    with pytest.raises(ValueError, match="not one a kubelet resolves"):
        _field(pod, "status.phase")
