"""The kserve deploy target: an endpoint as one KServe InferenceService, its canary moved by traffic.

``serving.kubernetes.kind: kserve`` serves each endpoint as a serving.kserve.io/v1beta1
InferenceService in ``serving.kubernetes.namespace`` of the private cluster, reached through the
cluster's kubeconfig Connection with the provider's ``KubernetesHook`` (its custom objects client).
The objects come from :mod:`hybridflow.serving.kserve_manifests`; the bundle is published on the
models volume as for the Deployment target (:func:`hybridflow.serving.k8s.publish_model`).

A first version is created taking all traffic, then smoke-tested and load-tested through the
InferenceService. A later version patches the predictor with ``canaryTrafficPercent: 0``: KServe makes
a new revision that takes no traffic and, with tag routing, answers on its own URL. Once it is ready
it is smoke-tested there (the model's metric on the held-out split against its gate), then the gate
load-tests it and the serving revision side by side (:func:`hybridflow.serving.rollout.run_gate`).
Traffic then moves through ``serving.canary.steps``: at each step ``canaryTrafficPercent`` is set,
the traffic table must show the split, and a window of load through the InferenceService's URL,
answered per version, judges the canary against the stable revision
(:func:`hybridflow.serving.rollout.run_window`); the last step (100: ``canaryTrafficPercent`` removed)
is the check after promotion. Any failure rolls back as KServe documents: ``canaryTrafficPercent: 0``
sends all traffic back to the previous rolled-out revision at once, then the previous predictor spec is
applied again, so the InferenceService runs the previous version in full. Re-deploying the version that
serves changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.errors import ConfigError, DeploymentError
from hybridflow.serving.base import DeployRequest, DeployTarget, Serving, Staged
from hybridflow.serving.k8s import publish_model
from hybridflow.serving.k8s_manifests import InferencePool, Release
from hybridflow.serving.kserve_manifests import (
    GROUP,
    PLURAL,
    SERVING_ANNOTATION,
    TAG_ROUTING,
    VARIANT_ANNOTATION,
    VERSION,
    inference_service,
    predictor_version,
    restore,
)
from hybridflow.serving.processes import say

if TYPE_CHECKING:
    from hybridflow.config import Estate, ServingSettings
    from hybridflow.serving.checks import DeployPlan

API_TIMEOUT_S = 30.0  # every call to the API server is bounded
# Knative Serving's Service: served where KServe can run in Serverless mode, the only mode in which it
# splits traffic by canaryTrafficPercent.
KNATIVE_SERVICES = ("serving.knative.dev", "v1", "services")


class InferenceServiceApi:
    """The endpoint's InferenceService through the hook's custom objects client."""

    def __init__(self, hook: Any, namespace: str, name: str) -> None:
        self.hook, self.namespace, self.name = hook, namespace, name

    def _kw(self) -> dict[str, Any]:
        return {"group": GROUP, "version": VERSION, "plural": PLURAL, "namespace": self.namespace,
                "_request_timeout": API_TIMEOUT_S}

    def read(self) -> dict[str, Any] | None:
        try:
            return self.hook.custom_object_client.get_namespaced_custom_object(name=self.name, **self._kw())
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return None
            raise

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.hook.custom_object_client.create_namespaced_custom_object(body=body, **self._kw())

    def patch(self, body: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (the custom objects client's default for a map)."""
        return self.hook.custom_object_client.patch_namespaced_custom_object(name=self.name, body=body, **self._kw())

    def apply(self, body: dict[str, Any], replacing: dict[str, Any] | None = None) -> None:
        """Create the InferenceService (patched to ``body`` if it exists already, e.g. a rerun), or,
        with ``replacing`` (the predictor spec in place), patch it so ``body``'s predictor replaces that
        one whole: keys it does not set go, where a merge patch alone would keep them."""
        if replacing is None:
            try:
                self.create(body)
                return
            except Exception as exc:
                if getattr(exc, "status", None) != 409:
                    raise
        else:
            for key in replacing:
                body["spec"]["predictor"].setdefault(key, None)
        self.patch(body)

    def knative_served(self) -> bool | None:
        """Whether the cluster serves Knative Serving's API; None where this identity may not ask.

        KServe resolves an InferenceService asking for Serverless mode on a cluster without Knative
        to a terminal error that it logs but never writes to the status (KServe v0.20), so without
        this a deploy would wait its whole ready timeout for nothing."""
        group, version, plural = KNATIVE_SERVICES
        try:
            self.hook.custom_object_client.list_namespaced_custom_object(
                group=group, version=version, plural=plural, namespace=self.namespace, limit=1,
                _request_timeout=API_TIMEOUT_S)
        except Exception as exc:
            status = getattr(exc, "status", None)
            if status == 404:  # the API server does not serve the group: no Knative Serving
                return False
            if status in (401, 403):
                return None
            raise
        return True

    def delete(self) -> bool:
        try:
            self.hook.custom_object_client.delete_namespaced_custom_object(name=self.name, **self._kw())
        except Exception as exc:
            if getattr(exc, "status", None) != 404:
                raise
            return False
        return True


@dataclass(frozen=True)
class IsvcState:
    """What an InferenceService's status says about its predictor."""

    generation: int
    observed: int
    latest_created: str | None
    latest_ready: str | None
    rolled_out: str | None
    traffic: tuple[dict[str, Any], ...]
    url: str | None
    failure: str | None  # a condition saying the latest revision failed, with its message

    @classmethod
    def of(cls, obj: dict[str, Any]) -> IsvcState:
        status = obj.get("status") or {}
        pred = (status.get("components") or {}).get("predictor") or {}
        failure = next((f"{c.get('type')}: {c.get('reason')}: {c.get('message', '')}".rstrip(": ")
                        for c in status.get("conditions") or []
                        if c.get("status") == "False" and "Failed" in str(c.get("reason"))), None)
        return cls(int((obj.get("metadata") or {}).get("generation") or 0), int(status.get("observedGeneration") or 0),
                   pred.get("latestCreatedRevision"), pred.get("latestReadyRevision"),
                   pred.get("latestRolledoutRevision"), tuple(pred.get("traffic") or ()), status.get("url"), failure)

    def share(self, revision: str | None) -> int:
        return sum(int(t.get("percent") or 0) for t in self.traffic if revision and t.get("revisionName") == revision)

    def url_of(self, revision: str | None) -> str | None:
        """The revision's own URL (tag routing) in the traffic table."""
        return next((t.get("url") for t in self.traffic if revision and t.get("revisionName") == revision
                     and t.get("url")), None)

    def serves_latest(self) -> bool:
        """The current spec's revision exists and is ready."""
        return self.observed >= self.generation and self.latest_created is not None and \
            self.latest_ready == self.latest_created


@dataclass(kw_only=True)
class _Revision(Staged):
    """The new version's predictor revision and what the deploy measured of it."""

    plan: DeployPlan = field(repr=False)
    release: Release
    revision: str | None = None
    stable_revision: str | None = None
    step: str = "readiness"
    promoted: bool = False
    stable_figures: Any = None
    outcome: dict[str, Any] = field(default_factory=dict)


class KServeTarget(DeployTarget[_Revision]):
    """An endpoint's versions as revisions of one InferenceService; traffic moves by canaryTrafficPercent."""

    name = "kserve"

    def __init__(self, api: InferenceServiceApi, pool: InferencePool, *, image: str, settings: ServingSettings,
                 server_args: Sequence[str] = (), models_dir: Path | None = None, timeout_s: float = 600,
                 poll_s: float = 2.0, log: Any = None, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, where: dict[str, Any] | None = None) -> None:
        self.api, self.pool, self.image, self.settings = api, pool, image, settings
        self.server_args, self.models_dir, self.timeout_s, self.poll_s = list(server_args), models_dir, timeout_s, poll_s
        self.log, self.sleep, self.clock, self.where = log, sleep, clock, where or {}

    @classmethod
    def from_estate(cls, estate: Estate, endpoint: str, *, state_dir: Path, log: Any = None) -> KServeTarget:
        from hybridflow.hooks.kubernetes import kubernetes_hook

        serving = estate.pipeline.serving
        k8s = serving.kubernetes
        if k8s is None:
            raise ConfigError("serving.target: 'kserve' needs serving.kubernetes (cluster, node_pool, image, "
                              "models_claim, models_dir, kind: kserve) in pipeline.yaml")
        cluster = estate.clusters[k8s.cluster]
        pool = InferencePool(endpoint=endpoint, namespace=k8s.namespace, pool=cluster.pool(k8s.node_pool),
                             models_claim=k8s.models_claim, replicas=k8s.replicas, port=k8s.port,
                             gpus_per_replica=k8s.gpus_per_replica)
        where = {"cluster": k8s.cluster, "namespace": k8s.namespace, "inference_service": endpoint}
        return cls(InferenceServiceApi(kubernetes_hook(cluster.conn_id), k8s.namespace, endpoint), pool, image=k8s.image,
                   settings=serving, server_args=_server_args(serving), models_dir=Path(k8s.models_dir),
                   timeout_s=k8s.ready_timeout_s, log=log, where=where)

    @property
    def endpoint(self) -> str:
        return self.pool.endpoint

    # --- before anything changes --------------------------------------------------------------------

    def prepare(self, request: DeployRequest) -> DeployPlan:
        """The bundle checked (card, weights, signature, smoke rows and metric) and published on the models volume."""
        from hybridflow.serving.checks import DeployPlan

        if request.smoke is None or request.bundle_dir is None:
            raise ValueError("smoke, bundle_dir: the kserve target smoke-tests every version through its "
                             "InferenceService; pass the bundle and the held-out (inputs, targets)")
        self._check_serverless()
        plan = DeployPlan(Path(request.bundle_dir), request.version, self.endpoint, self.pool.port, request.smoke(),
                          request.metric)
        release = Release(version=request.version, variant=plan.card.variant, image=self.image)
        inference_service(self.pool, release, self.server_args)  # a bad pool or release fails here
        if self.models_dir is not None:
            published = publish_model(plan.bundle_dir, self.models_dir, self.endpoint, release)
            say(self.log, f"Model {release.version} ({release.variant}) published to {published}")
        return plan

    def _check_serverless(self) -> None:
        """Refuse, before anything changes, a cluster where KServe cannot run in Serverless mode."""
        served = self.api.knative_served()
        where = f"cluster {self.where['cluster']}" if self.where.get("cluster") else "the serving cluster"
        if served is False:
            raise DeploymentError(
                f"{where} serves no Knative Serving API ({'/'.join(KNATIVE_SERVICES[:2])}), and serving.kubernetes."
                f"kind: kserve moves a canary's traffic with canaryTrafficPercent, which KServe supports only in "
                f"Serverless mode, over Knative: install Knative Serving (and its networking layer) there, or "
                f"serve with serving.kubernetes.kind: deployment; nothing was changed")
        if served is None:
            say(self.log, f"{self.endpoint}: could not check {where} for Knative Serving (no permission to list "
                          f"{KNATIVE_SERVICES[0]} services in {self.pool.namespace}); going on")

    def current(self) -> Serving | None:
        obj = self.api.read()
        if obj is None:
            return None
        meta, spec = obj.get("metadata") or {}, (obj.get("spec") or {}).get("predictor") or {}
        annotations = meta.get("annotations") or {}
        state = IsvcState.of(obj)
        version = annotations.get(SERVING_ANNOTATION) or predictor_version(spec)
        return Serving(version, {"predictor": spec, "variant": annotations.get(VARIANT_ANNOTATION),
                                 "revision": state.rolled_out, "url": state.url,
                                 "canary": spec.get("canaryTrafficPercent"), "ready": state.serves_latest()})

    def keep(self, current: Serving, plan: DeployPlan) -> dict[str, Any] | None:
        detail = current.detail
        if predictor_version(detail.get("predictor")) != plan.version or detail.get("canary") is not None \
                or not detail.get("ready"):
            return None  # a canary of another version left half-way, or not serving: deploy again
        say(self.log, f"{self.endpoint} version {plan.version} already serves all traffic of InferenceService "
                      f"{self.pool.namespace}/{self.endpoint}; nothing to do")
        outcome = self._outcome(plan, current)
        outcome.update(previous_version=plan.version, status="kept", url=detail.get("url"))
        return outcome

    def _outcome(self, plan: DeployPlan, previous: Serving | None) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "version": plan.version,
                "previous_version": previous.version if previous else None, "model": plan.card.model,
                "variant": plan.card.variant, "target": self.name, "smoke_metric": None, "gate": None,
                "canary": [], "rolled_back": None, "status": "deploying", **self.where}

    # --- the new revision -----------------------------------------------------------------------------

    def stage(self, plan: DeployPlan, current: Serving | None) -> _Revision:
        release = Release(version=plan.version, variant=plan.card.variant, image=self.image)
        staged = _Revision(plan.version, current, plan=plan, release=release, outcome=self._outcome(plan, current))
        if current is None:
            self.api.apply(inference_service(self.pool, release, self.server_args, serving_version=plan.version))
            say(self.log, f"InferenceService {self.pool.namespace}/{self.endpoint} created for {plan.version}")
            return staged
        staged.stable_revision = current.detail.get("revision")
        self.api.apply(inference_service(self.pool, release, self.server_args, canary_percent=0,
                                         serving_version=current.version),
                       replacing=current.detail.get("predictor") or {})
        say(self.log, f"{self.endpoint}: new revision for {plan.version} next to {current.version} "
                      f"(revision {staged.stable_revision}), taking no traffic yet")
        return staged

    def wait_for(self, what: str, done: Callable[[IsvcState], bool]) -> IsvcState:
        """Poll the InferenceService until ``done``; DeploymentError on timeout or a failed revision."""
        deadline = self.clock() + self.timeout_s
        while True:
            obj = self.api.read()
            if obj is None:
                raise DeploymentError(f"InferenceService {self.pool.namespace}/{self.endpoint} is gone while "
                                      f"waiting for {what}")
            state = IsvcState.of(obj)
            if done(state):
                return state
            if state.failure and state.observed >= state.generation:
                raise DeploymentError(f"{what}: the InferenceService reports {state.failure}")
            if self.clock() >= deadline:
                raise DeploymentError(f"{what} did not happen within {self.timeout_s:g} s (latest created revision "
                                      f"{state.latest_created}, latest ready {state.latest_ready}, traffic "
                                      f"{_traffic(state)}); see the revision's pods' events and logs")
            self.sleep(self.poll_s)

    def check(self, staged: _Revision) -> None:
        """The new revision ready, its smoke metric within the gate, then the gate's numbers."""
        from hybridflow.serving.checks import predict
        from hybridflow.serving.rollout import run_gate

        plan, version = staged.plan, staged.version
        staged.step = "readiness"
        state = self.wait_for(f"revision of {version} ready", lambda s: s.serves_latest() and
                              (staged.previous is not None or s.share(s.latest_ready) == 100))
        staged.revision = state.latest_ready
        new_url = state.url_of(staged.revision) or (state.url if staged.previous is None else None)
        if new_url is None:
            raise DeploymentError(f"revision {staged.revision} has no URL of its own in the traffic table "
                                  f"({_traffic(state)}): set the annotation {TAG_ROUTING}: 'true'")
        serving_url = state.url_of(staged.stable_revision) if staged.previous is not None else None
        staged.step = "smoke test"
        value = plan.score(predict(new_url, self.endpoint, plan.rows, version))
        metric = plan.metric
        staged.outcome["smoke_metric"] = {"name": metric.name, "value": value, "gate": metric.gate}
        say(self.log, f"{self.endpoint} version {version} smoke {metric.name} {value:.4f} on {len(plan.rows)} known "
                      f"inputs through revision {staged.revision} (gate {metric.gate:g}, {metric.better} is better)")
        if not metric.passes(value):
            side = "below" if metric.better == "higher" else "above"
            raise DeploymentError(f"smoke {metric.name} {value:.4f} on {len(plan.rows)} known inputs is {side} the "
                                  f"gate {metric.gate:g}")
        staged.step = "gate"
        outcome, _, serving = run_gate(new_url, serving_url, self.endpoint, plan.rows, self.settings.gate,
                                       version=version, serving_version=staged.previous.version if serving_url
                                       else None, log=self.log)
        staged.outcome["gate"] = outcome
        staged.stable_figures = serving
        if not outcome["passed"]:
            raise DeploymentError("the gate: " + "; ".join(outcome["reasons"]))

    def steps(self, staged: _Revision) -> Sequence[int]:
        """``serving.canary.steps``; a first version takes all traffic from the start."""
        return list(self.settings.canary.steps) if staged.previous is not None else ()

    def shift(self, staged: _Revision, percent: int) -> None:
        """Set ``canaryTrafficPercent``, wait for the split, then judge a window of traffic."""
        from hybridflow.serving.rollout import run_window

        version = staged.version
        staged.step = f"canary at {percent} %" if percent < 100 else "promotion"
        patch: dict[str, Any] = {"spec": {"predictor": {"canaryTrafficPercent": percent if percent < 100 else None}}}
        if percent >= 100:
            patch["metadata"] = {"annotations": {SERVING_ANNOTATION: version,
                                                 VARIANT_ANNOTATION: staged.release.variant}}
            staged.promoted = True
        self.api.patch(patch)
        state = self.wait_for(f"{percent} % of the traffic on {version}",
                              lambda s: s.serves_latest() and s.share(staged.revision) == percent)
        say(self.log, f"{self.endpoint}: traffic {_traffic(state)}")
        if percent >= 100:
            staged.step = "check after promotion"
        step, stable = run_window(state.url or "", self.endpoint, staged.plan.rows, self.settings.canary,
                                  self.settings.gate, percent=percent, version=version,
                                  stable_version=staged.previous.version if staged.previous else None,
                                  stable_before=staged.stable_figures, log=self.log)
        staged.outcome["canary"].append(step)
        staged.stable_figures = stable
        if not step["passed"]:
            raise DeploymentError(f"{staged.step}: " + "; ".join(step["reasons"]))

    # --- the end ----------------------------------------------------------------------------------------

    def rollback(self, staged: _Revision, error: BaseException) -> Exception | None:
        """Traffic back to the previous revision at once, then its spec applied again; a first version
        that failed is removed. The error names the step, the reason and what serves now."""
        previous, reason = staged.previous, str(error)
        staged.outcome.update(status="rolled_back", rolled_back={
            "step": staged.step, "reason": reason, "serving": previous.version if previous else None})
        if previous is None:
            self.api.delete()
            message = (f"{self.endpoint} version {staged.version} failed at the {staged.step}: {reason}; its "
                       f"InferenceService was removed (no version served before)")
        else:
            try:
                self._restore(staged, previous)
            except Exception as exc:  # noqa: BLE001 - reported with the failure that caused the rollback
                staged.outcome["rolled_back"]["error"] = str(exc)
                message = (f"{self.endpoint} version {staged.version} failed at the {staged.step}: {reason}; the "
                           f"rollback to {previous.version} did not finish: {exc}")
            else:
                message = (f"{self.endpoint} version {staged.version} failed at the {staged.step}: {reason}; rolled "
                           f"back, {previous.version} serves all traffic")
        say(self.log, message)
        replacement = DeploymentError(message)
        replacement.outcome = staged.outcome
        return replacement

    def _restore(self, staged: _Revision, previous: Serving) -> None:
        if not staged.promoted:
            self.api.patch({"spec": {"predictor": {"canaryTrafficPercent": 0}}})
        obj = self.api.read() or {}
        failed = (obj.get("spec") or {}).get("predictor")
        self.api.patch(restore(dict(previous.detail.get("predictor") or {}), failed, previous.version or "",
                               previous.detail.get("variant")))
        state = self.wait_for(f"the restored revision of {previous.version} taking all traffic",
                              lambda s: s.serves_latest() and s.share(s.latest_ready) == 100)
        staged.outcome["rolled_back"]["revision"] = state.latest_ready

    def retire(self, staged: _Revision) -> None:
        """Nothing to stop: the previous revision keeps no traffic, and KServe scales it down."""
        staged.outcome["status"] = "deployed"
        if staged.previous is not None:
            say(self.log, f"{self.endpoint} version {staged.version} serves all traffic (revision {staged.revision});"
                          f" revision {staged.stable_revision} of {staged.previous.version} takes none")

    def result(self, staged: _Revision) -> dict[str, Any]:
        obj = self.api.read() or {}
        staged.outcome.update(status="deployed", url=IsvcState.of(obj).url, revision=staged.revision)
        return staged.outcome

    def live_versions(self) -> dict[str, str | None]:
        """The serving version, and the predictor's during a canary (the newest revision runs it)."""
        live: dict[str, str | None] = {}
        current = self.current()  # each call bounded by the target's own timeout
        if current is not None and current.version:
            live[current.version] = current.detail.get("variant")
            canary = predictor_version(current.detail.get("predictor"))
            if canary:
                live.setdefault(canary, None)
        return live

    # -- the disaster-recovery side (a target made by hybridflow.serving.takeover.pool_target) --
    def take_over(self, version: str, bundle: Path) -> tuple[str, Any, bool]:
        """Serve ``version`` of ``bundle`` with all traffic at once: (``status.url``, the answer to one
        prediction made from the model's signature, whether anything was started). An InferenceService
        ready with that version and answering starts nothing."""
        from hybridflow.bundle import read_card
        from hybridflow.serving.checks import StepFailed, predict
        from hybridflow.serving.takeover import probe_rows

        rows = probe_rows(bundle)
        current = self.current()
        detail = current.detail if current is not None else {}
        if current is not None and current.version == version and detail.get("ready") and detail.get("canary") is None:
            try:
                return str(detail.get("url")), predict(str(detail.get("url")), self.endpoint, rows, version)[0], False
            except (StepFailed, OSError):
                pass  # it stands but does not answer: applied again below
        release = Release(version=version, variant=read_card(bundle).variant, image=self.image)
        published = publish_model(bundle, self.models_dir, self.endpoint, release)
        say(self.log, f"{self.endpoint} {version} published on the DR models volume at {published}")
        body = inference_service(self.pool, release, self.server_args, serving_version=version)
        if current is not None:
            body["spec"]["predictor"]["canaryTrafficPercent"] = None  # all traffic to this version
        self.api.apply(body, replacing=None if current is None else detail.get("predictor") or {})
        state = self.wait_for(f"{version} on the DR side ready with all traffic",
                              lambda s: s.serves_latest() and s.share(s.latest_ready) == 100 and bool(s.url))
        try:
            answer = predict(state.url, self.endpoint, rows, version)
        except (StepFailed, OSError) as exc:
            raise DeploymentError(f"{version} on the DR side is ready but did not answer a prediction at "
                                  f"{state.url}: {exc}") from exc
        return state.url, answer[0], True

    def remove(self) -> bool:
        """Delete the endpoint's InferenceService; whether it was there."""
        return bool(self.api.delete())


def _traffic(state: IsvcState) -> str:
    return ", ".join(f"{t.get('revisionName')} {t.get('percent')} %" for t in state.traffic) or "none"


def _server_args(serving: ServingSettings) -> list[str]:
    """The ``serving.server`` settings as the model server's flags."""
    try:
        from hybridflow.serving.runtime import server_args
    except ImportError:  # a model server without these flags yet: its defaults apply
        return []
    return list(server_args(serving.server))
