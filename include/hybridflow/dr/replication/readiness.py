"""Whether a DR cluster could take over with what it is configured with: the Airflow Connections it
needs exist, (on Kubernetes) its training image is the one the other clusters' gangs run, and, when
models serve on Kubernetes (``serving.target`` kubernetes or kserve), it has an inference pool
(``dr.serving``) and the serving image is one fixed build.

Connections are looked up by id only (the task's secrets backend, environment or database);
nothing is read from them and nothing of them is logged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Missing:
    """Something the DR cluster needs that is not there, the field that names it, and the fix."""

    field: str
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}: {self.what}; {self.fix}"

    def to_dict(self) -> dict[str, str]:
        return {"field": self.field, "what": self.what, "fix": self.fix}


def needed_connections(cluster) -> list[tuple[str, str, str]]:
    """(field, Connection id, conn type) of every Connection a takeover on ``cluster`` uses."""
    out = []
    if cluster.cache is not None:
        out.append((f"clusters.{cluster.name}.cache.conn_id", cluster.cache.conn_id, "aws"))
    if cluster.runs_pods and cluster.conn_id:
        out.append((f"clusters.{cluster.name}.conn_id", cluster.conn_id, "kubernetes"))
    return out


def _how_to_add(conn_id: str, conn_type: str) -> str:
    if conn_type == "aws":
        return (f"add Airflow Connection {conn_id} of type aws with the DR store's keys and endpoint_url "
                f"(`airflow connections add {conn_id} --conn-type aws --conn-login <key id> --conn-password <secret> "
                f"--conn-extra '{{\"endpoint_url\": \"<url>\"}}'`, AIRFLOW_CONN_{conn_id.upper()} or the secrets "
                "backend; docs/storage.md)")
    return (f"add Airflow Connection {conn_id} of type kubernetes with the DR cluster's kubeconfig in its kube_config "
            f"extra (AIRFLOW_CONN_{conn_id.upper()} or the secrets backend; docs/kubernetes.md)")


def _airflow_lookup(conn_id: str) -> None:
    from airflow.sdk import BaseHook

    BaseHook.get_connection(conn_id)


def _is_not_found(exc: BaseException) -> bool:
    return type(exc).__name__ in ("AirflowNotFoundException", "KeyError", "LookupError")


def _pinned(image: str) -> bool:
    """Whether an image reference names one build: a digest, or a tag other than ``latest``."""
    if "@" in image:
        return True
    name = image.rsplit("/", 1)[-1]
    return ":" in name and name.rsplit(":", 1)[1] not in ("", "latest")


def serving_missing(cluster, estate) -> list[Missing]:
    """What a Kubernetes DR cluster lacks to serve the replicated models in a takeover, when the
    estate serves on Kubernetes; nothing for a local DR cluster or the local model gateway."""
    from hybridflow.serving import target_name

    serving = estate.pipeline.serving
    target = target_name(serving)
    if not cluster.runs_pods or target == "local":
        return []
    missing = []
    at = f"clusters.{cluster.name}.dr.serving"
    pool = cluster.dr.serving if cluster.dr is not None else None
    if pool is None:
        missing.append(Missing(at, f"not set: models serve on Kubernetes (serving.target {target}), so a takeover "
                                   "serves the replicated models from an inference pool of this cluster, and it "
                                   "has none",
                               "add dr.serving to the cluster in clusters.yaml: {node_pool: <one of its node_pools>, "
                               "models_claim: <the PersistentVolumeClaim of its models volume>, models_dir: <where "
                               "that volume is mounted on the Airflow workers>} (docs/disaster-recovery.md)"))
    elif not pool.models_dir.startswith("/"):
        missing.append(Missing(f"{at}.models_dir", f"{pool.models_dir!r} is not an absolute path",
                               "set it to the absolute path where models_claim is mounted on the Airflow workers"))
    image = serving.kubernetes.image if serving.kubernetes is not None else None
    # The DR pool runs serving.kubernetes.image itself; a floating reference can still pull other code
    # there at takeover time than the primary's pods loaded.
    if image and (any(c.isspace() for c in image) or not _pinned(image)):
        missing.append(Missing("serving.kubernetes.image",
                               f"{image} names no fixed build (no tag, or latest), so a takeover may serve other "
                               "code than the primary",
                               "pin the serving image by a version tag or a digest (image:1.4 or image@sha256:...)"))
    return missing


def check_readiness(cluster, estate, *, lookup: Callable[[str], Any] | None = None) -> list[Missing]:
    """What ``cluster`` lacks for a takeover (empty: nothing). ``lookup(conn_id)`` raises when the
    Connection does not exist (default: Airflow's)."""
    lookup = lookup or _airflow_lookup
    missing = []
    for where, conn_id, conn_type in needed_connections(cluster):
        try:
            lookup(conn_id)
        except Exception as exc:  # noqa: BLE001 - not found, or a secrets backend that does not answer
            what = (f"Airflow Connection {conn_id} does not exist" if _is_not_found(exc)
                    else f"Airflow Connection {conn_id} cannot be looked up ({type(exc).__name__})")
            missing.append(Missing(where, what, _how_to_add(conn_id, conn_type)))
    if cluster.runs_pods:
        images = sorted({c.image for c in estate.clusters.values()
                         if c.runs_pods and not c.is_dr and c.image})
        # clusters.yaml already requires an image on Kubernetes; what it cannot tell is whether it is
        # the one the other clusters run.
        if images and cluster.image not in images:
            missing.append(Missing(f"clusters.{cluster.name}.image",
                                   f"{cluster.image} is not the image the other clusters run ({', '.join(images)})",
                                   "use the same training image on the DR cluster, so a takeover runs the same code"))
    return missing + serving_missing(cluster, estate)
