"""The serving meter: what every model version held while it served, one sample per version and
metering window, so the nightly allocation can cost inference per project and model version.

* On this machine (the local deploy target: ``serving.kubernetes`` unset) each model server process recorded under
  ``<state_dir>/serving/<endpoint>/versions/<version>.json`` holds one slot from its ``started_at`` to
  its ``stopped_at``; a record with no stop noted counts up to the window's end while its process is
  alive (and is still the server that was started), else not at all. The records keep their times,
  so a past window metered again gives the same slot-hours. Priced at ``serving.slot_price_per_hour``.
* On Kubernetes the objects labelled ``hybridflow.io/endpoint`` / ``hybridflow.io/version`` in
  ``serving.kubernetes.namespace`` are read: Deployments (``kind: deployment``, stable and canary
  tracks) or ``serving.kserve.io/v1beta1`` InferenceServices (``kind: kserve``: the predictor's
  replicas, and while a canary is under way the rolled-out revision's as well). Each holds replicas x
  GPUs per replica GPUs for the window, at the price of ``serving.kubernetes.node_pool`` in
  clusters.yaml. The API shows only the present: a window that ended longer ago than it lasted is
  skipped with a reason, as the GPU exporters' are.

A canary and the stable version serving at once are both sampled. Samples go to the ledger through
``hybridflow.ledger.inference.store_serving_samples``, which replaces the window's rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# The labels and resource hybridflow.serving.k8s_manifests puts on every serving object (the same strings).
ENDPOINT_LABEL, VERSION_LABEL, GPU_RESOURCE = "hybridflow.io/endpoint", "hybridflow.io/version", "nvidia.com/gpu"
LOCAL = "local"  # the cluster name of samples of this machine's model servers
SLOT, GPU = "slot", "gpu"
SERVER_MODULE = "hybridflow.serving.server"
API_TIMEOUT_S = 10.0  # each list call to the inference pool's API server
KSERVE = ("serving.kserve.io", "v1beta1", "inferenceservices")
# Written by the KServe deploy target: the version that takes all traffic, the previous revision's while
# a canary is under way (hybridflow.serving.kserve_manifests.SERVING_ANNOTATION).
SERVING_VERSION_ANNOTATION = "hybridflow.io/serving-version"


@dataclass(frozen=True, slots=True)
class ServingSample:
    """What one version of an endpoint held during [window_start, window_end): ``units`` slots or GPUs
    for ``unit_hours`` unit-hours (less than units x the window when it started or stopped inside it)."""

    window_start: datetime  # UTC, timezone-aware
    window_end: datetime
    cluster: str
    endpoint: str
    version: str
    model: str | None
    unit: str  # slot | gpu
    units: float
    unit_hours: float
    gpu_model: str | None
    pricing_class: str | None
    usd_per_unit_hour: float
    source: str

    def to_row(self) -> dict[str, Any]:
        """The ledger row (naive UTC times)."""
        row = {f: getattr(self, f) for f in self.__slots__}
        for key in ("window_start", "window_end"):
            row[key] = row[key].astimezone(UTC).replace(tzinfo=None)
        return row


def _when(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        ts = datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def server_running(record: dict[str, Any], record_path: Path) -> bool:
    """Whether the record's pid is alive and still the model server started for this version (pids
    are reused: its command line must name the server module and this version's ready file; a zombie
    has no command line)."""
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    return SERVER_MODULE in args and str(record_path.with_suffix(".ready")) in args


def local_samples(serving_root: Path, *, window_start: datetime, window_end: datetime, usd_per_slot_hour: float,
                  running: Callable[[dict, Path], bool] = server_running) -> list[ServingSample]:
    """One sample per version record under ``serving_root`` (``<state_dir>/serving``) that served
    during the window; ``running`` tells whether a record without a stop is still serving."""
    out = []
    root = Path(serving_root).resolve()
    for path in sorted(root.glob("*/versions/*.json")) if root.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced: write-then-rename, the next window reads it
        if not isinstance(record, dict):
            continue
        started, stopped = _when(record.get("started_at")), _when(record.get("stopped_at"))
        if started is None or started >= window_end:
            continue
        if stopped is None:
            if not running(record, path):
                continue  # gone without a stop noted: when it went is unknown, nothing is charged after it
            stopped = window_end
        held = (min(stopped, window_end) - max(started, window_start)).total_seconds()
        if held <= 0:
            continue
        out.append(ServingSample(
            window_start, window_end, LOCAL, str(record.get("endpoint") or path.parent.parent.name),
            str(record.get("version") or path.stem), record.get("model"), SLOT, 1.0, held / 3600.0, None, None,
            usd_per_slot_hour, f"{path.parent.parent.name}/versions/{path.name}",
        ))
    return out


def _get(obj: Any, *path: str) -> Any:
    """A field of a client model object or of a dict (custom objects come back as dicts)."""
    for key in path:
        if obj is None:
            return None
        obj = obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)
    return obj


def _limit_gpus(containers: Any) -> int:
    total = 0
    for c in containers or []:
        limits = _get(c, "resources", "limits") or {}
        total += int(limits.get(GPU_RESOURCE, 0) or 0)
    return total


def deployment_units(hook: Any, namespace: str) -> list[tuple[str, str, float, str]]:
    """(endpoint, version, GPUs, source) of each labelled Deployment: its pods (the status' count, else
    the spec's) x the GPUs its pod template asks for."""
    items = hook.apps_v1_client.list_namespaced_deployment(namespace, label_selector=ENDPOINT_LABEL,
                                                           _request_timeout=API_TIMEOUT_S).items
    out = []
    for dep in items:
        labels = _get(dep, "metadata", "labels") or {}
        replicas = _get(dep, "status", "replicas")
        replicas = _get(dep, "spec", "replicas") if replicas is None else replicas
        gpus = _limit_gpus(_get(dep, "spec", "template", "spec", "containers")) * int(replicas or 0)
        out.append((labels[ENDPOINT_LABEL], labels.get(VERSION_LABEL) or "?", float(gpus),
                    f"deployment/{_get(dep, 'metadata', 'name')}"))
    return out


def inference_service_units(hook: Any, namespace: str) -> list[tuple[str, str, float, str]]:
    """(endpoint, version, GPUs, source) of each labelled InferenceService: its latest revision runs the
    version in its labels, replicas (``minReplicas``, KServe's default 1) x the GPUs of the predictor's
    containers; every other revision in the predictor's traffic table (the rolled-out one while a
    canary takes its share, even 0 %) holds as much again, costed to the version the serving-version
    annotation names (else to ``?<revision>``, which no run owns). The spec says only the latest
    revision's size: the others are taken to be as large."""
    body = hook.custom_object_client.list_namespaced_custom_object(*KSERVE[:2], namespace, KSERVE[2],
                                                                   label_selector=ENDPOINT_LABEL,
                                                                   _request_timeout=API_TIMEOUT_S)
    out = []
    for isvc in body.get("items") or []:
        labels, name = _get(isvc, "metadata", "labels") or {}, _get(isvc, "metadata", "name")
        endpoint, version = labels[ENDPOINT_LABEL], labels.get(VERSION_LABEL) or "?"
        predictor = _get(isvc, "spec", "predictor") or {}
        replicas = predictor.get("minReplicas")
        containers = [*(predictor.get("containers") or []), *([predictor["model"]] if predictor.get("model") else [])]
        gpus = float(_limit_gpus(containers) * (1 if replicas is None else int(replicas)))
        out.append((endpoint, version, gpus, f"inferenceservice/{name}"))
        status = _get(isvc, "status", "components", "predictor") or {}
        latest = status.get("latestCreatedRevision")
        serving = (_get(isvc, "metadata", "annotations") or {}).get(SERVING_VERSION_ANNOTATION)
        others = sorted({t.get("revisionName") for t in status.get("traffic") or []} - {latest, None})
        for revision in others:
            was = serving if serving and serving != version else f"?{revision}"
            out.append((endpoint, was, gpus, f"inferenceservice/{name} revision {revision}"))
    return out


def kubernetes_samples(hook: Any, estate: Any, *, window_start: datetime, window_end: datetime) -> list[ServingSample]:
    """The inference pool's samples for the window (see the module doc)."""
    k8s = estate.pipeline.serving.kubernetes
    cluster = estate.clusters[k8s.cluster]
    pool = cluster.pool(k8s.node_pool)
    pclass = cluster.pricing_class(pool)
    lister = inference_service_units if k8s.kind == "kserve" else deployment_units
    hours = (window_end - window_start).total_seconds() / 3600.0
    summed: dict[tuple[str, str], tuple[float, list[str]]] = {}
    for endpoint, version, gpus, source in lister(hook, k8s.namespace):
        units, sources = summed.get((endpoint, version), (0.0, []))
        summed[(endpoint, version)] = (units + gpus, [*sources, source])
    return [ServingSample(window_start, window_end, cluster.name, endpoint, version, None, GPU, units, units * hours,
                          pool.gpu_model, pclass, float(cluster.prices[pclass]), ", ".join(sources)[:255])
            for (endpoint, version), (units, sources) in sorted(summed.items()) if units > 0]


def meter_serving(store: Callable[..., int], *, window_start: datetime, window_end: datetime, now: datetime,
                  estate: Any = None, state_dir: Path | None = None, hook: Any = None) -> dict[str, Any]:
    """Sample what served during [window_start, window_end) and hand it to ``store`` (the ledger's
    ``store_serving_samples``, which replaces the window's rows); returns a summary for XCom.
    ``hook``: the inference pool cluster's KubernetesHook (default: made from its Connection)."""
    from hybridflow.config import load_estate
    from hybridflow.settings import get_settings

    settings = get_settings()
    estate = estate or load_estate(settings.config_dir)
    serving = estate.pipeline.serving
    if serving.kubernetes is None or serving.target == "local":  # the local deploy target
        cluster = LOCAL
        samples = local_samples(Path(state_dir or settings.state_dir) / "serving", window_start=window_start,
                                window_end=window_end, usd_per_slot_hour=serving.slot_price_per_hour)
    else:
        cluster = serving.kubernetes.cluster
        if now - window_end > window_end - window_start:
            return {"cluster": cluster, "window_end": window_end.isoformat(), "samples": 0, "stored": 0,
                    "skipped": f"{cluster}: this window ended at {window_end.isoformat()}, more than "
                               f"{window_end - window_start} ago; the API shows only what serves now"}
        if hook is None:
            from hybridflow.hooks.kubernetes import kubernetes_hook

            hook = kubernetes_hook(estate.clusters[cluster].conn_id)
        samples = kubernetes_samples(hook, estate, window_start=window_start, window_end=window_end)
    stored = store(samples, cluster=cluster, window_start=window_start, window_end=window_end)
    return {"cluster": cluster, "window_end": window_end.isoformat(), "samples": len(samples), "stored": stored,
            "unit_hours": round(sum(s.unit_hours for s in samples), 6),
            "versions": sorted({f"{s.endpoint}/{s.version}" for s in samples}), "skipped": None}
