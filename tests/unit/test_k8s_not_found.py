"""A 404 from the Kubernetes API is read for what it says: the object asked for is gone (a job
already deleted: normal), or the cluster is set up differently from clusters.yaml (no such resource
type, no such namespace), which ends the work with the Connection named and the fix."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from hybridflow.backends.k8s.api import job_call, misconfiguration, missing


class _Response:
    def __init__(self, status: int, body: str) -> None:
        self.status, self.reason, self.data = status, "Not Found", body.encode()

    def getheaders(self) -> dict:
        return {"Content-Type": "application/json"}


def _answer(body: dict | str, status: int = 404) -> ApiException:
    return ApiException(http_resp=_Response(status, body if isinstance(body, str) else json.dumps(body)))


def _status(message: str, details: dict) -> dict:
    # The API server's Status body, as it answers a 404.
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": "NotFound", "details": details, "code": 404}


JOB_GONE = _status('jobs.batch "train-abc" not found', {"name": "train-abc", "group": "batch", "kind": "jobs"})
NO_NAMESPACE = _status('namespaces "ml-train" not found', {"name": "ml-train", "kind": "namespaces"})
NO_RESOURCE = _status("the server could not find the requested resource", {})
NO_GROUP = "404 page not found\n"  # an API group the server does not serve at all: not even a Status


@pytest.mark.parametrize(("body", "what"), [(JOB_GONE, "object"), (NO_NAMESPACE, "namespace"),
                                            (NO_RESOURCE, "resource"), (NO_GROUP, "resource")])
def test_a_404_says_what_is_missing(body, what):
    assert missing(_answer(body)) == what


def test_only_a_404_is_read_as_missing():
    assert missing(_answer(_status("forbidden", {}), status=403)) is None


def test_a_job_that_is_gone_is_no_misconfiguration():
    assert misconfiguration(_answer(JOB_GONE), "k8s_dc2", job_call("get", "kueue", "ml-train")) is None


def test_volcano_not_installed_names_the_connection_the_resource_and_the_fix():
    problem = misconfiguration(_answer(NO_GROUP), "k8s_dc2", job_call("create", "volcano", "ml-train"))
    assert "'k8s_dc2'" in problem and "jobs.batch.volcano.sh" in problem
    assert "install the scheduler" in problem and "clusters.yaml" in problem


def test_a_missing_namespace_names_it_and_the_fix():
    problem = misconfiguration(_answer(NO_NAMESPACE), "k8s_dc2", job_call("create", "kueue", "ml-train"))
    assert "namespace ml-train does not exist" in problem and "'k8s_dc2'" in problem
    assert "create it" in problem
