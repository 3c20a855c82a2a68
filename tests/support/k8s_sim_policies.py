"""The job controllers' failure policies, as the cluster simulator (:mod:`tests.support.k8s_sim`)
applies them to a failed pod.

Volcano's job controller takes the first entry of ``spec.policies`` whose ``event``/``events``
include the pod's event (``*`` for any), or whose ``exitCode`` equals the exit code the pod's
container ended with; none matching: no action. Kubernetes' Job controller takes the first rule of
``spec.podFailurePolicy`` whose ``onPodConditions`` the pod has (type and status) or whose
``onExitCodes`` requirement a terminated container of the named container meets (exit code 0 never
matches; ``In``: the code is listed, ``NotIn``: it is not); none matching: the failure counts
towards ``backoffLimit``.
"""

from __future__ import annotations


def volcano_action(policies: list[dict], event: str, exit_code: int | None) -> str | None:
    for policy in policies or []:
        events = ([policy["event"]] if policy.get("event") else []) + list(policy.get("events") or [])
        if events and (event in events or "*" in events):
            return policy["action"]
        if policy.get("exitCode") is not None and exit_code is not None and policy["exitCode"] == exit_code:
            return policy["action"]
    return None


def _codes_match(rule: dict, pod: dict, container: str) -> bool:
    need = rule["onExitCodes"]
    if pod.get("exit_code") in (None, 0) or need.get("containerName") not in (None, container):
        return False
    listed = pod["exit_code"] in need["values"]
    return listed if need["operator"] == "In" else not listed


def _conditions_match(rule: dict, pod: dict) -> bool:
    have = {"DisruptionTarget": "True"} if pod.get("disrupted") else {}
    return any(have.get(c["type"]) == c.get("status", "True") for c in rule["onPodConditions"])


def pod_failure_action(policy: dict | None, pod: dict, container: str) -> tuple[str, str]:
    """(action, message) for a failed pod: Ignore, FailJob or Count (no rule matched)."""
    for index, rule in enumerate((policy or {}).get("rules") or []):
        if rule.get("onExitCodes") and _codes_match(rule, pod, container):
            return rule["action"], (f"Container {container} for pod {pod['namespace']}/{pod['name']} failed with "
                                    f"exit code {pod['exit_code']} matching {rule['action']} rule at index {index}")
        if rule.get("onPodConditions") and _conditions_match(rule, pod):
            return rule["action"], (f"Pod {pod['namespace']}/{pod['name']} has condition DisruptionTarget matching "
                                    f"{rule['action']} rule at index {index}")
    return "Count", ""
