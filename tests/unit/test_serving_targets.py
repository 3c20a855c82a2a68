"""Deploy targets: the name -> implementation table, the error for a name it does not hold, and the
blue/green sequence every target is driven through (steps in order, traffic in steps, rollback on a
failed check or step, the version already serving kept as it is)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hybridflow.config import KubernetesServing, ServingSettings, load_estate
from hybridflow.config.pipeline import DEPLOY_TARGET_NAMES
from hybridflow.errors import ConfigError, DeploymentError
from hybridflow.serving import DEPLOY_TARGETS, deploy_target, target_class, target_name
from hybridflow.serving.base import DeployRequest, DeployTarget, Serving, Staged, roll
from hybridflow.serving.deploy import LocalTarget
from hybridflow.serving.k8s import KubernetesTarget
from hybridflow.settings import REPO_ROOT


@pytest.mark.parametrize("name", ["inferenceservice", "Local", "", None])
def test_an_unknown_target_is_refused_naming_the_field_and_the_valid_names(name):
    names = ", ".join(sorted(DEPLOY_TARGETS))
    with pytest.raises(ConfigError, match=rf"^serving\.target: .* is not a deploy target; use one of: {names}$"):
        target_class(name)


def test_the_table_resolves_every_name_to_its_implementation():
    assert target_class("local") is LocalTarget and target_class("kubernetes") is KubernetesTarget
    # config checks serving.target against its own list of names: a target added here and not there
    # would be refused by every estate that names it.
    assert sorted(DEPLOY_TARGETS) == sorted(DEPLOY_TARGET_NAMES)
    for name in DEPLOY_TARGETS:
        cls = target_class(name)
        assert issubclass(cls, DeployTarget) and cls.name == name


def test_the_serving_settings_name_the_target():
    assert target_name(ServingSettings()) == "local"
    pool = KubernetesServing(cluster="dc2-k8s", node_pool="l4", image="registry.local/serve:1",
                             models_claim="private-models", models_dir="/mnt/models")
    assert target_name(ServingSettings(kubernetes=pool)) == "kubernetes"
    # serving.target names it outright (a pool may be described and still not be used)
    assert target_name(ServingSettings(kubernetes=pool, target="local")) == "local"


def test_the_estate_without_an_inference_pool_deploys_locally(tmp_path):
    estate = load_estate(REPO_ROOT / "config", use_cache=False)
    target = deploy_target(estate, "digits", state_dir=tmp_path)
    assert isinstance(target, LocalTarget)
    assert (target.state_root, target.endpoint, target.port) == (tmp_path / "serving", "digits",
                                                                  estate.pipeline.serving.port)
    with pytest.raises(ConfigError, match="serving.target: 'inferenceservice'"):
        deploy_target(estate, "digits", state_dir=tmp_path, name="inferenceservice")
    # Naming the kubernetes target without its pool says what is missing.
    with pytest.raises(ConfigError, match="^serving.kubernetes: not set"):
        deploy_target(estate, "digits", state_dir=tmp_path, name="kubernetes")


@dataclass(kw_only=True)
class _Green(Staged):
    traffic: int = 0


class _Recorder(DeployTarget[_Green]):
    """A target that records the calls :func:`roll` makes; ``fail_at`` names a step that raises."""

    name = "recorder"

    def __init__(self, serving: str | None, *, steps: tuple[int, ...] = (100,), fail_at: str | None = None,
                 healthy: bool = True) -> None:
        self.serving, self.step_list, self.fail_at, self.healthy = serving, steps, fail_at, healthy
        self.calls: list[str] = []

    @classmethod
    def from_estate(cls, estate: Any, endpoint: str, *, state_dir: Path, log: Any = None) -> _Recorder:
        return cls(None)

    def _do(self, call: str) -> None:
        self.calls.append(call)
        if call == self.fail_at:
            raise DeploymentError(f"{call} failed")

    def prepare(self, request: DeployRequest) -> str:
        self._do("prepare")
        return request.version

    def current(self) -> Serving | None:
        self._do("current")
        return Serving(self.serving) if self.serving else None

    def keep(self, current: Serving, plan: str) -> dict[str, Any] | None:
        self._do("keep")
        return {"strategy": "unchanged", "version": plan} if self.healthy else None

    def stage(self, plan: str, current: Serving | None) -> _Green:
        self._do("stage")
        return _Green(plan, current)

    def check(self, staged: _Green) -> None:
        self._do("check")

    def steps(self, staged: _Green) -> tuple[int, ...]:
        return self.step_list

    def shift(self, staged: _Green, percent: int) -> None:
        staged.traffic = percent
        self._do(f"shift {percent}")

    def rollback(self, staged: _Green, error: BaseException) -> Exception | None:
        self.calls.append(f"rollback at {staged.traffic}")
        return DeploymentError(f"rolled back: {error}")

    def retire(self, staged: _Green) -> None:
        self._do("retire")

    def result(self, staged: _Green) -> dict[str, Any]:
        return {"version": staged.version, "previous": staged.previous.version if staged.previous else None}


def test_roll_moves_traffic_in_the_targets_steps_then_retires_the_old_version():
    target = _Recorder("v1", steps=(10, 50, 100))
    assert roll(target, DeployRequest("v2")) == {"version": "v2", "previous": "v1"}
    assert target.calls == ["prepare", "current", "stage", "check", "shift 10", "shift 50", "shift 100", "retire"]


@pytest.mark.parametrize(("fail_at", "traffic"), [("check", 0), ("shift 50", 50)])
def test_a_failed_check_or_step_rolls_back_and_nothing_is_retired(fail_at, traffic):
    target = _Recorder("v1", steps=(10, 50, 100), fail_at=fail_at)
    with pytest.raises(DeploymentError, match=f"rolled back: {fail_at} failed"):
        roll(target, DeployRequest("v2"))
    assert target.calls[-1] == f"rollback at {traffic}" and "retire" not in target.calls


def test_the_version_already_serving_is_kept_unless_it_must_be_deployed_again():
    kept = _Recorder("v2")
    assert roll(kept, DeployRequest("v2")) == {"strategy": "unchanged", "version": "v2"}
    assert kept.calls == ["prepare", "current", "keep"]
    gone = _Recorder("v2", healthy=False)  # e.g. its server died: deployed again next to nothing healthy
    assert roll(gone, DeployRequest("v2")) == {"version": "v2", "previous": "v2"}
    assert gone.calls[-5:] == ["keep", "stage", "check", "shift 100", "retire"]


def test_a_bad_request_stops_before_anything_is_looked_at():
    target = _Recorder(None, fail_at="prepare")
    with pytest.raises(DeploymentError, match="prepare failed"):
        roll(target, DeployRequest("v1"))
    assert target.calls == ["prepare"]


class _Scripted(_Recorder):
    """A local-looking target whose roll result, or failure, is given."""

    name = "local"

    def __init__(self, outcome: dict[str, Any], error: str | None) -> None:
        super().__init__(None)
        self.outcome, self.error = outcome, error

    def check(self, staged: _Green) -> None:
        if self.error:
            raise DeploymentError(self.error, outcome=self.outcome)

    def rollback(self, staged: _Green, error: BaseException) -> Exception | None:
        return None

    def result(self, staged: _Green) -> dict[str, Any]:
        return self.outcome


@pytest.mark.parametrize("error", [None, "the gate: p99 9.0 ms is above the gate's 1 ms (serving.gate.p99_ms)"])
def test_the_deploy_step_writes_its_outcome_for_the_run_page_whether_it_deployed_or_not(tmp_path, monkeypatch, error):
    import json
    import shutil
    from types import SimpleNamespace

    from tests.support.bundles import card

    from hybridflow import bundle, pipeline, serving
    from hybridflow.runs import run_dir

    shutil.copytree(REPO_ROOT / "config", tmp_path / "config")
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(tmp_path / "config"))
    run = {"run_key": "hybrid-training-outcome"}
    monkeypatch.setattr(pipeline, "_admitted", lambda r: SimpleNamespace(deploy=True, model="digits-mlp"))
    c = card("digits-mlp", variant="fp32", version=run["run_key"])
    bundle_dir = bundle.write_bundle(tmp_path / "b", bundle.serialise_state(bundle.build_module(c)), c)
    outcome = {"endpoint": "digits", "version": run["run_key"], "status": "rolled_back" if error else "deployed",
               "gate": {"passed": not error, "reasons": [error] if error else []}}
    monkeypatch.setattr(serving, "deploy_target", lambda *a, **k: _Scripted(outcome, error))
    if error:
        with pytest.raises(DeploymentError, match="the gate: p99"):  # the error stands
            pipeline.deploy(run, {"bundle": str(bundle_dir), "selected": "fp32"})
    else:
        assert pipeline.deploy(run, {"bundle": str(bundle_dir), "selected": "fp32"})["deployed"] is True
    from hybridflow.settings import get_settings

    written = json.loads((run_dir(get_settings().private_root, run["run_key"]) / "deploy.json").read_text())
    assert written == ({**outcome, "error": error} if error else outcome)
