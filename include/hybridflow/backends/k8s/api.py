"""How a failed Kubernetes API call is read: worth retrying, or a misconfiguration to report.

Transient: no answer at all (connection refused or reset, a timeout, a name that does not resolve)
or an answer that says "later" (429, 500, 502, 503, 504). Misconfiguration: 401 (the Connection's
credentials are refused), 403 (its identity lacks an RBAC verb on a resource), and a 404 that is not
about the object asked for: the cluster serves no such resource type (the scheduler's CRDs are not
installed: the API server answers "404 page not found", or a Status without the object's name) or
the namespace does not exist. The message names the Connection and what to change.

A 404 Status naming the object (``details.name``) only says that object does not exist: a job
already deleted, which callers handle as such.

:func:`ride_out` is the blocking wait's way through an outage: transient errors are retried with
backoff for up to ``training.kubernetes_api_outage_s``, as the trigger does in the triggerer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from hybridflow.backends.k8s.load import describe_error

TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """What an API call needs in RBAC terms: ``verb`` on ``resource`` of API ``group``."""

    verb: str
    resource: str
    group: str = ""
    namespace: str | None = None

    @property
    def qualified(self) -> str:
        return f"{self.resource}.{self.group}" if self.group else self.resource


def job_call(verb: str, scheduler: str, namespace: str) -> Call:
    """The RBAC terms of a gang job call on ``scheduler`` (volcano or kueue)."""
    if scheduler == "volcano":
        return Call(verb, "jobs", "batch.volcano.sh", namespace)
    return Call(verb, "jobs", "batch", namespace)


def is_transient(exc: BaseException) -> bool:
    """True if the call may well succeed when tried again shortly."""
    status = getattr(exc, "status", None)
    if status:
        return status in TRANSIENT_STATUS
    from urllib3.exceptions import HTTPError

    return isinstance(exc, HTTPError | ConnectionError | TimeoutError)


def _server_message(exc: BaseException) -> str:
    try:
        return str(json.loads(getattr(exc, "body", None) or "{}").get("message") or "")
    except (TypeError, ValueError):
        return ""


def _status_details(exc: BaseException) -> dict | None:
    """The ``details`` of the API server's Status body; None when the body is not a Status at all
    (e.g. the plain "404 page not found" of an API group the server does not serve)."""
    body = getattr(exc, "body", None)
    try:
        doc = json.loads(body) if body else None
    except (TypeError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("kind") != "Status":
        return None
    details = doc.get("details")
    return details if isinstance(details, dict) else {}


def missing(exc: BaseException) -> str | None:
    """For a 404: ``"resource"`` when the cluster serves no such resource type, ``"namespace"`` when
    the namespace does not exist, ``"object"`` when the object asked for does not exist (or the
    answer does not say: read as before, the object is gone). None for anything but a 404."""
    if getattr(exc, "status", None) != 404:
        return None
    body = getattr(exc, "body", None)
    details = _status_details(exc)
    if details is None:
        return "resource" if body else "object"
    if details.get("kind") == "namespaces":
        return "namespace"
    return "object" if details.get("name") else "resource"


def misconfiguration(exc: BaseException, conn_id: str, call: Call) -> str | None:
    """What to fix when ``exc`` says the Connection cannot do ``call`` at all; None otherwise."""
    status = getattr(exc, "status", None)
    said = _server_message(exc)
    where = f" in namespace {call.namespace}" if call.namespace else ""
    gone = missing(exc)
    if gone == "resource":
        return (f"the Kubernetes API of Connection {conn_id!r} serves no {call.qualified} (404 Not Found"
                f"{': ' + said if said else ''}); install the scheduler that provides it on the cluster, or set "
                "the cluster's scheduler in clusters.yaml to the one installed there")
    if gone == "namespace":
        return (f"namespace {call.namespace} does not exist on the cluster of Connection {conn_id!r} (404 Not "
                "Found); create it, or set the cluster's namespace in clusters.yaml to one that exists")
    if status == 401:
        return (f"the Kubernetes API refused the credentials of Connection {conn_id!r} (401 Unauthorized"
                f"{': ' + said if said else ''}); renew the token or client certificate in its kubeconfig")
    if status == 403:
        return (f"Connection {conn_id!r} may not {call.verb} {call.qualified}{where} (403 Forbidden"
                f"{': ' + said if said else ''}); grant its identity a Role rule with apiGroups "
                f"[{call.group!r}], resources [{call.resource!r}], verbs [{call.verb!r}]")
    return None


def describe(exc: BaseException) -> str:
    return describe_error(exc)


def ride_out(read: Callable[[], T], *, conn_id: str, call: Call, what: str, outage_s: float,
             sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
             log: Any = None) -> T:
    """``read()``, with transient API errors retried (backoff 0.5 s doubling, at most 10 s) for up to
    ``outage_s``; the blocking wait's form of the trigger's. A misconfiguration, an error that is not
    transient, or an API away for longer raises :class:`GangError` naming ``what`` and the Connection."""
    from hybridflow.errors import GangError

    since, delay = None, 0.5
    while True:
        try:
            return read()
        except Exception as exc:
            problem = misconfiguration(exc, conn_id, call)
            if problem or not is_transient(exc):
                raise GangError(f"could not read {what}: {problem or describe(exc)}") from exc
            now = clock()
            since = now if since is None else since
            if now - since >= outage_s:
                raise GangError(f"the Kubernetes API (Connection {conn_id!r}) was unreachable for {now - since:.0f} s "
                                f"while waiting for {what} (training.kubernetes_api_outage_s): {describe(exc)}; "
                                "the gang is left as it is, a retry re-attaches to it") from exc
            if log is not None:
                log.warning("%s: Kubernetes API not answering (%s); retrying in %.1f s", what, describe(exc), delay)
            sleep(min(delay, max(0.0, outage_s - (now - since))))
            delay = min(delay * 2, 10.0)
