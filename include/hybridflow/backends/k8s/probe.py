"""One authenticated request to a Kubernetes cluster's API server through its Connection, and what
went wrong when it does not answer: named by the cluster, the Connection, what is wrong and the fix,
never the kubeconfig's contents. Used by admission (:mod:`hybridflow.conncheck`) through
:func:`hybridflow.backends.probe_connection`."""

from __future__ import annotations

import re
import tempfile
from typing import TYPE_CHECKING, Any

from hybridflow.backends.base import ConnectionProblem

if TYPE_CHECKING:
    from hybridflow.config import Cluster

_KUBECONFIG_FIX = ("fix the kube_config (or kube_config_path) extra of Connection {conn}: a kubeconfig (YAML or JSON) "
                   "with clusters, users, contexts and current-context")
# The hook loads a kube_config extra from a temporary copy: its name says nothing to the reader.
_TEMP_COPY = re.compile(r"\s*\bin\s+\"?" + re.escape(tempfile.gettempdir()) + r"/\S+")


def probe(cluster: Cluster, timeout_s: float) -> ConnectionProblem | None:
    """None when the cluster's API server answers through its Connection within ``timeout_s``."""
    from airflow.sdk.exceptions import AirflowNotFoundException

    from hybridflow.hooks.kubernetes import kubernetes_hook

    conn_id = str(cluster.conn_id)

    def problem(what: str, fix: str) -> ConnectionProblem:
        return ConnectionProblem(cluster.name, conn_id, what, fix)

    hook = kubernetes_hook(conn_id)
    try:
        hook.get_connection(conn_id)
    except AirflowNotFoundException:
        return problem("the Connection does not exist",
                       f"create Airflow Connection {conn_id} of type kubernetes with the cluster's kubeconfig in its "
                       f"kube_config extra (AIRFLOW_CONN_{conn_id.upper()} or the secrets backend), or set "
                       f"clusters.{cluster.name}.conn_id in clusters.yaml to the Connection that has it")
    try:
        api = hook.custom_object_client if cluster.scheduler == "volcano" else hook.batch_v1_client
    except Exception as exc:  # noqa: BLE001 - whatever the loader raised is the kubeconfig's fault
        return problem(f"kubeconfig unreadable: {_loader_message(exc)}", _KUBECONFIG_FIX.format(conn=conn_id))
    try:
        _list_gang_jobs(api, cluster, timeout_s)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a named problem
        return problem(*_unanswered(exc, api, cluster, timeout_s))
    return None


def _list_gang_jobs(api: Any, cluster: Cluster, timeout_s: float) -> None:
    """One authenticated request the gang backend's credentials must allow: list its jobs, limit 1."""
    from hybridflow.backends.k8s.manifests import VOLCANO_GROUP, VOLCANO_PLURAL, VOLCANO_VERSION

    kw = {"namespace": cluster.k8s_namespace, "limit": 1, "_request_timeout": timeout_s}
    if cluster.scheduler == "volcano":
        api.list_namespaced_custom_object(group=VOLCANO_GROUP, version=VOLCANO_VERSION, plural=VOLCANO_PLURAL, **kw)
    else:
        api.list_namespaced_job(**kw)


def _loader_message(exc: BaseException) -> str:
    """The kubeconfig loader's complaint, without the text around it (which may hold credentials)."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:  # a YAML syntax error
        context = f"{exc.context}: " if getattr(exc, "context", None) else ""
        return f"{context}{exc.problem} at line {mark.line + 1}, column {mark.column + 1}"
    text = _TEMP_COPY.sub("", " ".join(str(exc).split()))
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _unanswered(exc: BaseException, api: Any, cluster: Cluster, timeout_s: float) -> tuple[str, str]:
    """(what went wrong, the fix) for a probe the API server did not answer with success."""
    from urllib3.exceptions import NameResolutionError, NewConnectionError, SSLError, TimeoutError

    from hybridflow.backends.k8s.load import describe_error

    conn, ns = cluster.conn_id, cluster.k8s_namespace
    jobs = "Volcano Jobs (batch.volcano.sh)" if cluster.scheduler == "volcano" else "Jobs (batch)"
    status = getattr(exc, "status", None)
    if status == 401:
        return ("the API server refused its credentials (401 Unauthorized)",
                f"renew the token or client certificate of the kubeconfig's user in Connection {conn}")
    if status == 403:
        return (f"its user may not list {jobs} in namespace {ns} (403 Forbidden)",
                f"grant the kubeconfig's user a Role in namespace {ns} to manage {jobs}, or use a Connection whose "
                "user has one")
    if status == 404:
        return (f"the API server has no {jobs} in namespace {ns} (404 Not Found)",
                f"install {cluster.scheduler} on the cluster, or check clusters.{cluster.name}.namespace")
    if status is not None:
        return (f"the API server answered {describe_error(exc)}", "see the API server's log; placement uses the "
                "cluster again once it answers")
    cause = getattr(exc, "reason", None) if isinstance(getattr(exc, "reason", None), BaseException) else exc
    where = _server(exc, api)
    check = f"check the server address in the kubeconfig of Connection {conn}"
    if isinstance(cause, NameResolutionError):
        return f"the API server's host name does not resolve ({where})", check
    if isinstance(cause, NewConnectionError) and "refused" in str(cause).lower():
        return (f"connection refused at {where}",
                f"{check} and that the API server is up and reachable from the Airflow workers")
    if isinstance(cause, SSLError):
        return f"TLS failed at {where}: {describe_error(cause)}", f"{check} and its certificate-authority-data"
    if isinstance(cause, TimeoutError) and not isinstance(cause, NewConnectionError):
        return (f"no answer from {where} within {timeout_s:g} s",
                f"{check} and the network path to it, or raise placement.cluster_read_timeout_s in pipeline.yaml")
    return f"cannot reach the API server at {where}: {describe_error(exc)}", check


def _server(exc: BaseException, api: Any) -> str:
    """host:port the request went to (from the connection pool, else the client's configuration)."""
    pool = getattr(exc, "pool", None)
    if getattr(pool, "host", None):
        return f"{pool.host}:{pool.port}"
    host = getattr(getattr(getattr(api, "api_client", None), "configuration", None), "host", None)
    return str(host).split("://", 1)[-1] if host else "its server"
