"""Serving failover and failback of a Kubernetes inference pool (kind kserve): `cluster down` on the
primary serves the replicated model from an InferenceService on the DR cluster's pool, even with the
primary's API server unreachable; `cluster up` removes it only once the primary's InferenceService
answers and passes the gate. Two cluster simulators with KServe (in-process predictors), a local DR
store holding the replicas."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from tests.support import bundles, dr_k8s
from tests.support.dr_k8s import DR, DR_NS, PRIMARY
from tests.support.serving import INT_DIGITS, http_call, predict_url

from hybridflow.config import load_estate
from hybridflow.dr.failover.serving import fail_over
from hybridflow.dr.fencing.drain import fence_and_drain
from hybridflow.dr.fencing.failback import declare_up
from hybridflow.errors import ConfigError
from hybridflow.fencing import down_clusters, serving_stayed, state_path
from hybridflow.storage.objectstore import StoreSpec

REASON = "power loss in dc-1"


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """digits bundles v1 (fp32) and v2 (int8) of a briefly trained model, and one input row."""
    root = tmp_path_factory.mktemp("dr-k8s-bundles")
    data = bundles.seed("digits-mlp", root / "data")
    module = bundles.train("digits-mlp", data, steps=30)
    made = {v: bundles.make_bundle(root / v, "digits-mlp", module, variant=variant, version=v, signature=INT_DIGITS)
            for v, variant in (("v1", "fp32"), ("v2", "int8"))}
    return SimpleNamespace(bundles=made, row=[int(v) for v in data.xy("test", 1)[0][0]])


@pytest.fixture
def estate(tmp_path: Path, monkeypatch, digits):
    """The two clusters (kserve), digits v1 serving on the primary, v1 replicated to the DR store."""
    sims = dr_k8s.clusters(monkeypatch, tmp_path)
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    try:
        est = load_estate(dr_k8s.write_config(tmp_path), use_cache=False)
        _serve_on_primary(est, tmp_path, "v1", digits)
        dr_k8s.replicate(tmp_path / "dr-store", "digits", "v1", digits.bundles["v1"], "digits-mlp")
        yield SimpleNamespace(estate=est, sims=sims, state=tmp_path / "home" / "state", base=tmp_path,
                              spec=StoreSpec(kind="local", root=str(tmp_path / "dr-store")))
    finally:
        sims.close()


def _serve_on_primary(estate, base: Path, version: str, digits) -> None:
    from hybridflow.serving.k8s import publish_model
    from hybridflow.serving.k8s_manifests import Release
    from hybridflow.serving.kserve import KServeTarget
    from hybridflow.serving.kserve_manifests import inference_service

    target = KServeTarget.from_estate(estate, "digits", state_dir=base / "home" / "state")
    release = Release(version, "fp32", dr_k8s.IMAGE)
    publish_model(digits.bundles[version], target.models_dir, "digits", release)
    target.api.create(inference_service(target.pool, release, target.server_args, serving_version=version))
    assert target.current().detail["ready"]


class _NoGangs:
    def find_gangs(self, labels, *, not_labels=None) -> list[str]:
        return []


def _down(env) -> dict:
    return fence_and_drain(PRIMARY, REASON, by="ops", estate=env.estate, state_dir=env.state,
                           backend_factory=lambda *_: _NoGangs(), dr_spec=env.spec)


def _dr_isvc(env) -> dict | None:
    try:
        return env.sims.dr_kserve.get(DR_NS, "digits")
    except Exception as exc:  # noqa: BLE001 - the simulator's 404
        if getattr(exc, "status", None) == 404:
            return None
        raise


def _answer(url: str, row: list[int]) -> tuple[int, dict]:
    status, body, _ = http_call("POST", predict_url(url, "digits"), {"instances": [row]}, timeout=5)
    return status, body


def test_cluster_down_serves_the_replica_from_an_inference_service_on_the_dr_pool(estate, digits) -> None:
    estate.sims.primary.unreachable = True  # the primary's API server is gone with the cluster
    change = _down(estate)
    serving = change["record"]["drain"]["serving"]
    moved = serving["endpoints"]["digits"]
    assert moved["state"] == "on dr" and serving["drained"] and serving["dr_cluster"] == DR
    assert f"{PRIMARY} did not answer" in serving["endpoints_from"]
    dr = moved["dr"]
    assert (dr["cluster"], dr["namespace"], dr["inference_service"], dr["version"]) == (DR, DR_NS, "digits", "v1")
    assert "newest replicated version v1" in dr["source"]
    status, body = _answer(dr["url"], digits.row)
    assert status == 200 and body["version"] == "v1" and len(body["predictions"]) == 1
    isvc = _dr_isvc(estate)
    assert isvc["spec"]["predictor"]["nodeSelector"] == {"hybridflow.io/pool": "inference"}
    assert (estate.base / "dr-models" / "digits" / "v1" / "fp32").is_dir()  # published on the DR volume
    record = json.loads((estate.state / "serving" / "digits" / "takeover-k8s.json").read_text())
    assert record["url"] == dr["url"] and record["cluster"] == DR
    assert PRIMARY in down_clusters(state_path(estate.state))

    generation = isvc["metadata"]["generation"]
    again = fail_over(PRIMARY, estate.estate, estate.state, dr_spec=estate.spec)["endpoints"]["digits"]
    assert again["state"] == "on dr" and again["note"] == "served on the DR side already"
    assert again["dr"]["since"] == record["since"] and not again["dr"]["started"]
    assert _dr_isvc(estate)["metadata"]["generation"] == generation  # nothing applied again


def test_a_primary_that_answers_names_the_version_it_serves(estate, digits) -> None:
    dr_k8s.replicate(estate.base / "dr-store", "digits", "v2", digits.bundles["v2"], "digits-mlp")  # newer
    moved = _down(estate)["record"]["drain"]["serving"]["endpoints"]["digits"]
    assert moved["dr"]["version"] == "v1" and moved["dr"]["source"] == "the active version v1, replicated"
    assert _answer(moved["dr"]["url"], digits.row)[1]["version"] == "v1"


def test_no_replica_leaves_the_endpoint_not_moved_and_the_fence_standing(tmp_path, monkeypatch, digits) -> None:
    sims = dr_k8s.clusters(monkeypatch, tmp_path)
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    try:
        env = SimpleNamespace(estate=load_estate(dr_k8s.write_config(tmp_path), use_cache=False), sims=sims,
                              state=tmp_path / "home" / "state", spec=StoreSpec(kind="local", root=str(tmp_path / "s")))
        _serve_on_primary(env.estate, tmp_path, "v1", digits)
        serving = _down(env)["record"]["drain"]["serving"]
        moved = serving["endpoints"]["digits"]
        assert moved["state"] == "not moved" and not serving["drained"]
        assert "no model of digits is replicated to the DR store" in moved["reason"]
        assert _dr_isvc(env) is None and PRIMARY in down_clusters(state_path(env.state))
    finally:
        sims.close()


def test_a_store_error_fails_the_drain_naming_the_endpoint_and_a_rerun_moves_it(estate, digits) -> None:
    from hybridflow.dr.fencing.drain import DrainIncomplete

    manifest = estate.base / "dr-store" / "models" / "digits" / "v1" / "MANIFEST.json"
    good = manifest.read_text()
    manifest.write_text(good[: len(good) // 2])  # cut short: what a torn copy or a full disk leaves
    with pytest.raises(DrainIncomplete) as failed:
        _down(estate)
    assert "endpoint digits: JSONDecodeError" in str(failed.value)
    drain = down_clusters(state_path(estate.state))[PRIMARY]["drain"]
    assert drain["complete"] is False and drain["serving"]["endpoints"]["digits"]["state"] == "failed"
    assert _dr_isvc(estate) is None  # nothing served from a replica that could not be read

    manifest.write_text(good)  # repaired: the rerun of the same declaration finishes the drain
    again = _down(estate)["record"]["drain"]
    assert again["complete"] is True and again["serving"]["endpoints"]["digits"]["state"] == "on dr"
    assert _answer(again["serving"]["endpoints"]["digits"]["dr"]["url"], digits.row)[0] == 200


def test_a_dr_cluster_without_dr_serving_moves_nothing_and_names_the_fix(tmp_path, monkeypatch, digits) -> None:
    from hybridflow.dr.failover.serving_k8s import dr_target

    sims = dr_k8s.clusters(monkeypatch, tmp_path)
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    try:
        est = load_estate(dr_k8s.write_config(tmp_path, dr_serving=False), use_cache=False)
        dr_k8s.replicate(tmp_path / "dr-store", "digits", "v1", digits.bundles["v1"], "digits-mlp")
        env = SimpleNamespace(estate=est, sims=sims, state=tmp_path / "home" / "state",
                              spec=StoreSpec(kind="local", root=str(tmp_path / "dr-store")))
        _serve_on_primary(est, tmp_path, "v1", digits)
        moved = _down(env)["record"]["drain"]["serving"]["endpoints"]["digits"]
        assert moved["state"] == "not moved"
        assert "clusters.dr-k8s.dr.serving: not set" in moved["reason"] and "models_claim" in moved["reason"]
        assert _dr_isvc(env) is None
        with pytest.raises(ConfigError, match=r"clusters\.dr-k8s\.dr\.serving"):
            dr_target(est, est.clusters[DR], "digits")
    finally:
        sims.close()


def test_the_deployment_kind_targets_the_dr_pool(tmp_path) -> None:
    from hybridflow.dr.failover.serving_k8s import dr_target
    from hybridflow.serving.k8s import KubernetesTarget

    est = load_estate(dr_k8s.write_config(tmp_path, kind="deployment"), use_cache=False)
    target = dr_target(est, est.clusters[DR], "digits")
    assert isinstance(target, KubernetesTarget)
    pool = target.rollout.pool
    assert (pool.namespace, pool.replicas, pool.models_claim, pool.pool.name) == (DR_NS, 1, "dr-models", "l4")
    assert target.models_dir == tmp_path / "dr-models" and target.where["endpoint_url"] == \
        f"http://digits.{DR_NS}.svc"


def test_up_keeps_serving_on_dr_while_the_primary_fails_then_moves_back(estate, digits) -> None:
    estate.sims.primary.unreachable = True
    dr_url = _down(estate)["record"]["drain"]["serving"]["endpoints"]["digits"]["dr"]["url"]
    estate.sims.primary.unreachable = False
    estate.sims.primary_kserve.faults["v1"] = 1  # the primary's revision answers 500
    change = declare_up(PRIMARY, by="ops", estate=estate.estate, path=state_path(estate.state))
    stayed = serving_stayed(change)
    assert len(stayed) == 1 and "did not answer the smoke check" in stayed[0] and "HTTP 500" in stayed[0]
    assert _dr_isvc(estate) is not None and _answer(dr_url, digits.row)[0] == 200
    assert (estate.state / "serving" / "digits" / "takeover-k8s.json").is_file()

    estate.sims.primary_kserve.faults.clear()
    change = declare_up(PRIMARY, by="ops", estate=estate.estate, path=state_path(estate.state))
    back = change.record["serving"]["endpoints"]["digits"]
    assert not serving_stayed(change) and back["state"] == "on primary" and back["dr_stopped"]
    assert back["gate"]["passed"] and back["primary"]["version"] == "v1"
    assert _dr_isvc(estate) is None
    assert not (estate.state / "serving" / "digits" / "takeover-k8s.json").exists()
    assert _answer(back["primary"]["url"], digits.row)[1]["version"] == "v1"


def test_a_local_dr_cluster_moves_nothing_and_says_why(tmp_path, monkeypatch, digits) -> None:
    sims = dr_k8s.clusters(monkeypatch, tmp_path)
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    try:
        est = load_estate(dr_k8s.write_config(tmp_path, dr_serving=False, dr_backend="local"), use_cache=False)
        dr_k8s.replicate(tmp_path / "dr-store", "digits", "v1", digits.bundles["v1"], "digits-mlp")
        env = SimpleNamespace(estate=est, sims=sims, state=tmp_path / "home" / "state",
                              spec=StoreSpec(kind="local", root=str(tmp_path / "dr-store")))
        _serve_on_primary(est, tmp_path, "v1", digits)
        serving = _down(env)["record"]["drain"]["serving"]
        assert serving["endpoints"]["digits"]["state"] == "not moved" and not serving["drained"]
        assert "has backend local" in serving["note"] and "backend: kubernetes DR cluster" in serving["note"]
        assert PRIMARY in down_clusters(state_path(env.state))
    finally:
        sims.close()


class _Deployments:
    """One cluster's Deployments and Services (kind deployment), as the rollout's fake holds them, also
    listed by label; ``unreachable``: every call fails as a cluster that is gone."""

    def __init__(self) -> None:
        from tests.unit.test_serving_k8s import _Store

        self.store, self.unreachable = _Store(), False

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args, **kwargs):
            if self.unreachable:
                raise ConnectionRefusedError(111, "Connection refused")
            return method(*args, **kwargs)
        return call

    def list_namespaced_deployment(self, namespace, label_selector, **kw):
        if self.unreachable:
            raise ConnectionRefusedError(111, "Connection refused")
        key, value = label_selector.split("=")
        items = [self.store.read_namespaced_deployment(name, namespace) for (kind, name), body in
                 self.store.objects.items() if kind == "Deployment" and body["metadata"]["labels"].get(key) == value]
        return SimpleNamespace(items=items)

    def delete_namespaced_service(self, name, namespace, **kw):
        from kubernetes.client.exceptions import ApiException

        if self.store.objects.pop(("Service", name), None) is None:
            raise ApiException(status=404, reason="NotFound")


def test_the_deployment_kind_fails_over_by_readiness_and_back(tmp_path, monkeypatch, digits) -> None:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    from hybridflow.serving.k8s import KubernetesTarget
    from hybridflow.serving.k8s_manifests import Release

    apis = {"k8s_private": _Deployments(), "k8s_dr": _Deployments()}
    for conn in apis:
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn.upper()}", "kubernetes://")
    monkeypatch.setattr(KubernetesHook, "apps_v1_client", property(lambda hook: apis[hook.conn_id]))
    monkeypatch.setattr(KubernetesHook, "core_v1_client", property(lambda hook: apis[hook.conn_id]))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    est = load_estate(dr_k8s.write_config(tmp_path, kind="deployment"), use_cache=False)
    KubernetesTarget.from_estate(est, "digits", state_dir=tmp_path).rollout.deploy(Release("v1", "fp32", dr_k8s.IMAGE))
    dr_k8s.replicate(tmp_path / "dr-store", "digits", "v1", digits.bundles["v1"], "digits-mlp")
    env = SimpleNamespace(estate=est, state=tmp_path / "home" / "state",
                          spec=StoreSpec(kind="local", root=str(tmp_path / "dr-store")))
    apis["k8s_private"].unreachable = True
    moved = _down(env)["record"]["drain"]["serving"]["endpoints"]["digits"]
    assert moved["state"] == "on dr" and moved["dr"]["deployment"] == "digits"
    assert moved["dr"]["url"] == f"http://digits.{DR_NS}.svc" and moved["dr"]["prediction"] is None
    dr_objects = apis["k8s_dr"].store.objects
    assert dr_objects[("Deployment", "digits")]["spec"]["replicas"] == 1 and ("Service", "digits") in dr_objects
    assert (tmp_path / "dr-models" / "digits" / "v1" / "fp32").is_dir()

    apis["k8s_private"].unreachable = False
    apis["k8s_private"].store.broken.add("v1")  # its pods never get ready
    stayed = serving_stayed(declare_up(PRIMARY, by="ops", estate=est, path=state_path(env.state)))
    assert len(stayed) == 1 and "is not ready with all traffic on v1" in stayed[0]
    assert ("Deployment", "digits") in dr_objects

    apis["k8s_private"].store.broken.clear()
    change = declare_up(PRIMARY, by="ops", estate=est, path=state_path(env.state))
    back = change.record["serving"]["endpoints"]["digits"]
    assert back["state"] == "on primary" and "readiness" in back["checked"] and not serving_stayed(change)
    assert not any(kind in ("Deployment", "Service") for kind, _ in dr_objects)


def test_start_on_dr_replaces_another_version_and_stop_on_dr_removes_it(estate, digits) -> None:
    from hybridflow.dr.failover.serving_k8s import start_on_dr, stop_on_dr

    dr_k8s.replicate(estate.base / "dr-store", "digits", "v2", digits.bundles["v2"], "digits-mlp")
    dr, scratch = estate.estate.clusters[DR], estate.base / "scratch-dr" / "serving"
    first = start_on_dr(estate.estate, dr, estate.spec, "digits", "v1", scratch)
    assert first["started"] and _answer(first["url"], digits.row)[1]["version"] == "v1"
    second = start_on_dr(estate.estate, dr, estate.spec, "digits", "v2", scratch)
    assert second["started"] and second["version"] == "v2" and second["source"] == "the active version v2, replicated"
    assert _answer(second["url"], digits.row)[1]["version"] == "v2"
    assert _dr_isvc(estate)["spec"]["predictor"].get("canaryTrafficPercent") is None
    assert stop_on_dr(estate.estate, dr, "digits") and _dr_isvc(estate) is None
    assert not stop_on_dr(estate.estate, dr, "digits")
