"""Steering a Kubernetes cluster away from an unhealthy node (:mod:`hybridflow.nodehealth` decides
when): cordon it (``spec.unschedulable``), taint it ``hybridflow.io/gpu-unhealthy=<reason>:NoSchedule``,
and restart every gang with a pod on it as a whole (all its pods deleted: Volcano's PodEvicted ->
RestartJob policy, or the Job controller for a Kueue-managed Job, recreates them away from the
cordoned node); and lift the cordon and the taint once the node is repaired."""

from __future__ import annotations

import re
from typing import Any

from hybridflow.backends.k8s.manifests import GANG_LABEL  # on every pod of a gang job

TAINT_KEY = "hybridflow.io/gpu-unhealthy"
_TAINT_VALUE_RE = re.compile(r"[^A-Za-z0-9_.-]")


class KubernetesNodeActions:
    """Cordon, taint and restart gangs on one Kubernetes cluster through the provider's hook."""

    def __init__(self, hook: Any, namespace: str) -> None:
        self.hook = hook
        self.namespace = namespace

    def cordon(self, node: str, reason: str) -> list[str]:
        core = self.hook.core_v1_client
        taints_now = core.read_node(name=node).spec.taints or []
        value = _TAINT_VALUE_RE.sub("-", reason)[:63].strip("-._") or "unhealthy"
        patch = node_cordon_patch(node, value, [_taint_dict(t) for t in taints_now])
        core.patch_node(name=node, body=patch)
        return [f"cordoned {node}", f"tainted {node} {TAINT_KEY}={value}:NoSchedule"]

    def uncordon(self, node: str) -> list[str]:
        """Make a repaired node schedulable again: lift the cordon and our taint (others stay)."""
        core = self.hook.core_v1_client
        taints = [_taint_dict(t) for t in core.read_node(name=node).spec.taints or []]
        kept = [t for t in taints if t.get("key") != TAINT_KEY]
        core.patch_node(name=node, body={"spec": {"unschedulable": False, "taints": kept}})
        return [f"uncordoned {node}"] + ([f"removed taint {TAINT_KEY} from {node}"] if len(kept) < len(taints) else [])

    def restart_gangs_on(self, node: str) -> list[str]:
        core = self.hook.core_v1_client
        pods = core.list_namespaced_pod(namespace=self.namespace, field_selector=f"spec.nodeName={node}")
        gangs = sorted({(p.metadata.labels or {}).get(GANG_LABEL) for p in pods.items} - {None})
        done = []
        for gang in gangs:
            members = core.list_namespaced_pod(namespace=self.namespace, label_selector=f"{GANG_LABEL}={gang}")
            for pod in members.items:
                core.delete_namespaced_pod(name=pod.metadata.name, namespace=self.namespace)
            done.append(f"restarted gang {gang} ({len(members.items)} pods deleted)")
        return done


def _taint_dict(taint: Any) -> dict:
    return {k: v for k, v in (("key", taint.key), ("value", taint.value), ("effect", taint.effect)) if v is not None}


def node_cordon_patch(node: str, reason: str, existing_taints: list[dict]) -> dict:
    """The Node patch that cordons and taints ``node``; other taints are kept (the taint list is
    replaced as a whole by a patch, so it must carry them)."""
    taints = [t for t in existing_taints if t.get("key") != TAINT_KEY]
    taints.append({"key": TAINT_KEY, "value": reason, "effect": "NoSchedule"})
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node},
            "spec": {"unschedulable": True, "taints": taints}}
