"""How a failed Kubernetes API call is read: worth retrying, or a misconfiguration to report.

Transient: no answer at all (connection refused or reset, a timeout, a name that does not resolve)
or an answer that says "later" (429, 500, 502, 503, 504). Misconfiguration: 401 (the Connection's
credentials are refused) and 403 (its identity lacks an RBAC verb on a resource); the message names
the Connection and, for 403, the verb, resource and namespace to grant.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hybridflow.backends.k8s.load import describe_error

TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})


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


def misconfiguration(exc: BaseException, conn_id: str, call: Call) -> str | None:
    """What to fix when ``exc`` says the Connection cannot do ``call`` at all; None otherwise."""
    status = getattr(exc, "status", None)
    said = _server_message(exc)
    where = f" in namespace {call.namespace}" if call.namespace else ""
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
