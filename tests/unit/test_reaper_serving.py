"""Serving versions that are neither stable nor canary: on the local target the versions
``active.json`` does not name (their server stopped, their files removed; an endpoint a deploy holds
is left alone), on Kubernetes the product's Deployments off both tracks and bundles nothing runs."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from hybridflow.errors import DeploymentError
from hybridflow.reaper.base import Leftover
from hybridflow.reaper.serving import KubernetesServingFinder, LocalServingFinder
from hybridflow.serving.deploy import SERVER_MODULE
from hybridflow.serving.processes import alive, cmdline

NOW = datetime.now(UTC)
OLD = (NOW - timedelta(days=3)).timestamp()


@pytest.fixture
def servers():
    """Stand-in model servers: sleeping processes whose command line names the server module and
    their version's ready file, as the deployer's servers do. Stopped at the end whatever happened."""
    started: list[subprocess.Popen] = []

    def start(edir, version) -> int:
        args = [sys.executable, "-c", "import time; time.sleep(120)", SERVER_MODULE,
                str(edir / "versions" / f"{version}.ready")]
        started.append(subprocess.Popen(args, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + 10  # for a moment after the spawn /proc shows no command line yet
        while SERVER_MODULE not in cmdline(started[-1].pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        return started[-1].pid

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _version(edir, version, pid=None, status="stopped", old=True):
    vdir = edir / "versions"
    vdir.mkdir(parents=True, exist_ok=True)
    record = vdir / f"{version}.json"
    record.write_text(json.dumps({"version": version, "pid": pid, "status": status, "started_at": NOW.isoformat()}))
    (vdir / f"{version}.log").write_text("server log")
    if old:
        os.utime(record, (OLD, OLD))


def test_local_versions_off_the_active_one_are_stopped_and_removed(tmp_path, servers):
    edir = tmp_path / "serving" / "digits"
    v2 = servers(edir, "v2")
    v1 = servers(edir, "v1")  # a retire that never happened: still running, nothing routes to it
    _version(edir, "v2", v2, "active")
    _version(edir, "v1", v1, "active")
    _version(edir, "v0", None, "failed")  # a failed deploy, days ago
    _version(edir, "v3", None, "failed", old=False)  # failed an hour ago: its log is still wanted
    (edir / "active.json").write_text(json.dumps({"version": "v2", "pid": v2}))
    finder = LocalServingFinder("serving", tmp_path / "serving")

    found = finder.find(NOW)
    assert [lo.name for lo in found] == ["digits/v0", "digits/v1"]
    assert "neither stable nor canary" in found[1].reason and f"pid {v1}" in found[1].reason
    for leftover in found:
        finder.release(leftover)
        finder.release(leftover)  # already gone
    assert not alive(v1) and alive(v2)
    assert sorted(p.name for p in (edir / "versions").iterdir()) == ["v2.json", "v2.log", "v3.json", "v3.log"]
    assert finder.find(NOW) == []


def test_a_canary_the_gateway_still_routes_to_is_kept(tmp_path, servers):
    """A deployer that died mid-canary leaves active.json naming the canary and its share: the gateway
    still sends it that share, so it is routed, not a leftover."""
    edir = tmp_path / "serving" / "digits"
    stable, canary = servers(edir, "v1"), servers(edir, "v2")
    _version(edir, "v1", stable, "active")
    _version(edir, "v2", canary, "starting")
    (edir / "active.json").write_text(json.dumps({"version": "v1", "pid": stable,
                                                  "canary": {"version": "v2", "pid": canary, "percent": 10}}))
    finder = LocalServingFinder("serving", tmp_path / "serving")
    assert finder.find(NOW) == []
    with pytest.raises(DeploymentError, match="kept"):
        finder.release(Leftover("serving", "serving-version", "digits/v2",
                                detail={"endpoint": "digits", "version": "v2", "pid": canary}))
    assert alive(canary) and alive(stable)


def test_an_endpoint_a_deploy_holds_is_not_touched(tmp_path, servers):
    edir = tmp_path / "serving" / "ranker"
    staging = servers(edir, "v9")
    _version(edir, "v9", staging, "starting")  # being staged by the deploy holding the lock
    finder = LocalServingFinder("serving", tmp_path / "serving")
    with open(edir / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert finder.find(NOW) == []
        found_before = Leftover("serving", "serving-version", "ranker/v9",
                                detail={"endpoint": "ranker", "version": "v9", "pid": staging})
        with pytest.raises(DeploymentError, match="deploy of ranker is under way"):
            finder.release(found_before)
        fcntl.flock(held, fcntl.LOCK_UN)
    assert alive(staging) and (edir / "versions" / "v9.json").is_file()
    # Once the deploy is gone and the version never became active, it is a leftover like any other.
    assert [lo.name for lo in finder.find(NOW)] == ["ranker/v9"]


def _obj(name, labels, gpus=0, replicas=None, owners=None):
    container = SimpleNamespace(resources=SimpleNamespace(limits={"nvidia.com/gpu": gpus} if gpus else None))
    return SimpleNamespace(
        metadata=SimpleNamespace(name=name, labels=labels, creation_timestamp=NOW - timedelta(days=1),
                                 owner_references=owners),
        spec=SimpleNamespace(replicas=replicas, template=SimpleNamespace(spec=SimpleNamespace(containers=[container]))),
    )


class _NotFound(Exception):
    status = 404


class _Hook:
    """apps/core (and, with ``isvcs``, KServe's custom objects) as the provider's hook hands them out;
    every call must carry a timeout."""

    def __init__(self, deployments, pods, isvcs=None):
        self.deployments, self.pods, self.isvcs, self.deleted = deployments, pods, isvcs, []
        self.apps_v1_client = SimpleNamespace(list_namespaced_deployment=self._list_deps,
                                              delete_namespaced_deployment=self._delete)
        self.core_v1_client = SimpleNamespace(list_namespaced_pod=self._list_pods)
        self.custom_object_client = SimpleNamespace(list_namespaced_custom_object=self._list_isvcs)

    def _list_deps(self, namespace, label_selector, _request_timeout):
        assert label_selector == "hybridflow.io/endpoint" and _request_timeout  # the product's label, bounded
        return SimpleNamespace(items=self.deployments)

    def _list_pods(self, namespace, label_selector, _request_timeout):
        assert label_selector == "hybridflow.io/endpoint" and _request_timeout
        return SimpleNamespace(items=self.pods)

    def _list_isvcs(self, group, version, namespace, plural, label_selector, _request_timeout):
        assert (group, plural, label_selector) == ("serving.kserve.io", "inferenceservices", "hybridflow.io/endpoint")
        if self.isvcs is None:
            raise _NotFound()  # KServe is not installed
        return {"items": self.isvcs}

    def _delete(self, name, namespace, _request_timeout):
        if name not in {d.metadata.name for d in self.deployments}:
            raise _NotFound()
        self.deleted.append((namespace, name))
        self.deployments = [d for d in self.deployments if d.metadata.name != name]


def _labels(track, version):
    return {"hybridflow.io/endpoint": "digits", "hybridflow.io/track": track, "hybridflow.io/version": version}


def test_kubernetes_deployments_off_both_tracks_and_unused_bundles_go(tmp_path):
    hook = _Hook(
        [_obj("digits", _labels("stable", "v3"), 1, 2), _obj("digits-canary", _labels("canary", "v4"), 1, 1),
         _obj("digits-blue", _labels("blue", "v1"), 1, 2)],
        [_obj("digits-abc", _labels("stable", "v2"))],  # an old pod of a rolling update still on v2
    )
    models = tmp_path / "models"
    for version in ("v0", "v1", "v2", "v3", "v4", "v5"):
        (models / "digits" / version / "fp32").mkdir(parents=True)
        if version != "v5":  # v5: published a minute ago by a deploy about to start its canary
            os.utime(models / "digits" / version, (OLD, OLD))
    finder = KubernetesServingFinder("private-k8s", hook, "serving", models_dir=models)

    found = {lo.name: lo for lo in finder.find(NOW)}
    assert sorted(found) == ["bundle/digits/v0", "deployment/digits-blue"]
    assert found["deployment/digits-blue"].gpus == 2
    for leftover in found.values():
        finder.release(leftover)
    finder.release(found["deployment/digits-blue"])  # already gone
    assert hook.deleted == [("serving", "digits-blue")]
    assert sorted(p.name for p in (models / "digits").iterdir()) == ["v1", "v2", "v3", "v4", "v5"]


def test_deployments_another_controller_owns_are_never_touched_and_inference_services_keep_their_versions(
        tmp_path):
    """KServe's RawDeployment predictors are Deployments carrying the InferenceService's labels (and
    no track): they belong to KServe, not to the reaper. The versions an InferenceService serves (its
    label and the serving-version annotation) keep their bundles."""
    owner = [SimpleNamespace(kind="InferenceService", name="digits", controller=True)]
    isvc = {"metadata": {"name": "digits", "labels": {"hybridflow.io/endpoint": "digits", "hybridflow.io/version": "v4"},
                         "annotations": {"hybridflow.io/serving-version": "v3"}}}
    hook = _Hook([_obj("digits-predictor", {"hybridflow.io/endpoint": "digits", "hybridflow.io/version": "v4"}, 1, 2,
                       owners=owner)], [], isvcs=[isvc])
    models = tmp_path / "models"
    for version in ("v2", "v3", "v4"):
        (models / "digits" / version / "fp32").mkdir(parents=True)
        os.utime(models / "digits" / version, (OLD, OLD))
    finder = KubernetesServingFinder("private-k8s", hook, "serving", models_dir=models, timeout_s=7)
    assert [lo.name for lo in finder.find(NOW)] == ["bundle/digits/v2"]
    assert hook.deleted == []


def test_the_estate_s_local_target_is_swept_in_its_state_folder(tmp_path):
    from hybridflow.config import load_estate
    from hybridflow.reaper.serving import finders
    from hybridflow.settings import REPO_ROOT

    estate = load_estate(REPO_ROOT / "config")
    built = finders(estate, SimpleNamespace(state_dir=tmp_path / "state"))
    assert [(type(f).__name__, f.place, f.root) for f in built] == [
        ("LocalServingFinder", "serving", (tmp_path / "state" / "serving").resolve())]
