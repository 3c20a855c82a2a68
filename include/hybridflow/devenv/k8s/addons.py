"""What each controller beside the core needs on a local control plane: its CRDs (from the Go module
its binary is built from), its configuration, and its admission webhooks registered by URL on
127.0.0.1 (the API server cannot reach an in-cluster Service here), plus kwok's stages."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from hybridflow.devenv.k8s.processes import ControlPlaneError

if TYPE_CHECKING:
    from hybridflow.devenv.k8s.controlplane import ControlPlane

BINARIES = {
    "kueue": ("kueue",),
    "volcano": ("vc-scheduler", "vc-controller-manager"),
    "kserve": ("kserve-manager",),
}
# Webhooks kept from a controller's manifests: those of the API groups the product uses (Kueue's own
# objects and batch Jobs; Volcano's and KServe's objects). Kueue's pod, Deployment and other framework
# webhooks are left out with their integrations.
WEBHOOK_GROUPS = {"kueue": {"kueue.x-k8s.io", "batch"}, "kserve": {"serving.kserve.io"}}


def _module_dir(project: str) -> Path:
    from hybridflow.devenv.k8s.build import module_dir

    return module_dir(project)


def kwok_stages(path: Path) -> Path:
    """kwok's configuration: its node stages (initialise, heartbeat with a Lease) and the pod stages
    that make a pod Running and finish its deletion, from the kwok module. kwok's pod-complete stage
    is left out on purpose: a gang's pods keep running until the test (or the node agent) ends them."""
    stage = _module_dir("kwok") / "kustomize" / "stage"
    files = [stage / "node" / "fast" / "node-initialize.yaml",
             stage / "node" / "heartbeat-with-lease" / "node-heartbeat-with-lease.yaml",
             stage / "pod" / "fast" / "pod-ready.yaml", stage / "pod" / "fast" / "pod-delete.yaml"]
    docs = [{"apiVersion": "config.kwok.x-k8s.io/v1alpha1", "kind": "KwokConfiguration",
             "options": {"enableCRDs": []}}]
    for file in files:
        docs.extend(d for d in yaml.safe_load_all(file.read_text()) if d)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def crd_files(addon: str) -> list[Path]:
    from hybridflow.devenv.k8s.build import crd_dirs

    files = []
    for folder in crd_dirs()[addon]:
        files.extend(sorted(p for p in Path(folder).rglob("*.yaml") if p.name != "kustomization.yaml"))
    return files


def apply_crds(plane: ControlPlane, addon: str) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    names = []
    with plane.api() as api:
        ext = client.ApiextensionsV1Api(api)
        for file in crd_files(addon):
            for doc in yaml.safe_load_all(file.read_text()):
                # kustomize patches sit beside the CRDs (kserve's llmisvc/): only whole definitions
                if not doc or doc.get("kind") != "CustomResourceDefinition" or not (doc.get("spec") or {}).get("versions"):
                    continue
                names.append(doc["metadata"]["name"])
                try:
                    ext.create_custom_resource_definition(doc)
                except ApiException as exc:
                    if exc.status != 409:
                        raise ControlPlaneError(f"the {addon} CRD {doc['metadata']['name']} from {file} was "
                                                f"refused: {exc.status} {exc.reason}: {exc.body[:500]}") from exc
        from hybridflow.devenv.k8s.controlplane import ready_timeout_s

        deadline = time.monotonic() + ready_timeout_s()
        pending = set(names)
        while pending:
            for name in list(pending):
                crd = ext.read_custom_resource_definition(name)
                if any(c.type == "Established" and c.status == "True" for c in (crd.status.conditions or [])):
                    pending.discard(name)
            if pending and time.monotonic() > deadline:
                raise ControlPlaneError(f"{addon} CRDs not established within {ready_timeout_s():.0f} s: "
                                        f"{sorted(pending)}; a loaded machine may need more: set "
                                        "HYBRIDFLOW_K8S_READY_TIMEOUT_S")
            time.sleep(0.2)
    plane.log(f"{addon}: {len(names)} CRDs established")


def ensure_namespace(plane: ControlPlane, name: str) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    with plane.api() as api:
        try:
            client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
        except ApiException as exc:
            if exc.status != 409:
                raise


def kueue_config(path: Path, *, webhook_port: int, probe_port: int, metrics_port: int, cert_dir: Path) -> Path:
    """Kueue's Configuration: batch/v1 Jobs as the one integration, no leader election, no internal
    certificate management (the control plane issues the webhook's certificate), every server on
    127.0.0.1."""
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{probe_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["batch/job"]},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def volcano_scheduler_conf(path: Path) -> Path:
    """Volcano's scheduler: gang admission, queue shares (proportion) and priority preemption, the
    actions and plugins of Volcano's own default configuration plus ``preempt``."""
    conf = {
        "actions": "enqueue, allocate, preempt, backfill",
        "tiers": [
            {"plugins": [{"name": "priority"}, {"name": "gang", "enablePreemptable": False},
                         {"name": "conformance"}]},
            {"plugins": [{"name": "overcommit"}, {"name": "drf", "enablePreemptable": False},
                         {"name": "predicates"}, {"name": "proportion"}, {"name": "nodeorder"},
                         {"name": "binpack"}]},
        ],
    }
    path.write_text(yaml.safe_dump(conf, sort_keys=False))
    return path


def kserve_config(plane: ControlPlane) -> None:
    """KServe's ``inferenceservice-config`` ConfigMap from its module, with the Standard (raw
    Deployment) mode as default and no Istio or ingress objects: the plane runs no Knative or mesh."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    source = _module_dir("kserve") / "config" / "configmap" / "inferenceservice.yaml"
    doc = next(d for d in yaml.safe_load_all(source.read_text()) if d and d.get("kind") == "ConfigMap")
    data = dict(doc.get("data") or {})
    deploy = yaml.safe_load(data.get("deploy") or "{}") or {}
    deploy["defaultDeploymentMode"] = "Standard"
    data["deploy"] = json.dumps(deploy)
    ingress = yaml.safe_load(data.get("ingress") or "{}") or {}
    ingress.update(disableIstioVirtualHost=True, disableIngressCreation=True)
    data["ingress"] = json.dumps(ingress)
    body = {"metadata": {"name": "inferenceservice-config", "namespace": "kserve"}, "data": data}
    with plane.api() as api:
        core = client.CoreV1Api(api)
        try:
            core.create_namespaced_config_map("kserve", body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            core.replace_namespaced_config_map("inferenceservice-config", "kserve", body)


def register_webhooks(plane: ControlPlane, addon: str, port: int) -> None:
    """The addon's Mutating/ValidatingWebhookConfigurations from its module, for the groups the product
    uses, pointed at its webhook server on 127.0.0.1:``port`` with the plane's CA."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    source = {"kueue": _module_dir("kueue") / "config" / "components" / "webhook" / "manifests.yaml",
              "kserve": _module_dir("kserve") / "config" / "webhook" / "manifests.yaml"}[addon]
    ca = base64.b64encode(plane.pki.ca_crt.read_bytes()).decode()
    groups = WEBHOOK_GROUPS[addon]
    with plane.api() as api:
        adm = client.AdmissionregistrationV1Api(api)
        for doc in yaml.safe_load_all(source.read_text()):
            if not doc or doc.get("kind") not in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
                continue
            hooks = []
            for hook in doc.get("webhooks") or []:
                rule_groups = {g for rule in hook.get("rules", []) for g in rule.get("apiGroups", [])}
                if not rule_groups or not rule_groups <= groups:
                    continue
                path = hook["clientConfig"]["service"].get("path", "/")
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}
                hooks.append(hook)
            if not hooks:
                continue
            name = f"{addon}-{doc['metadata']['name']}"
            body = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": doc["kind"],
                    "metadata": {"name": name}, "webhooks": hooks}
            create = (adm.create_mutating_webhook_configuration if doc["kind"].startswith("Mutating")
                      else adm.create_validating_webhook_configuration)
            try:
                create(body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
    plane.log(f"{addon}: webhooks registered at https://127.0.0.1:{port}")
