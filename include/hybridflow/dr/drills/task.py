"""The ``dr_drill`` DAG's task units (:mod:`hybridflow.dr.drills.drill`): its trigger form's Params, and
one function per step. Every step reads the same drill id (the DAG run's), so a step cleared and
run again carries on the same drill.

Kept free of Airflow and heavy imports at module level: the DAG file reads :data:`DRILL_PARAMS`
while it is parsed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hybridflow.dr.drills.report import DEFAULT_INFERENCE_RTO_S, DEFAULT_TRAINING_RTO_S

DRILL_PARAMS: dict[str, dict[str, Any]] = {
    "primary": {
        "default": None, "type": ["null", "string"], "title": "Primary to declare down",
        "description": "A role: primary cluster of config/clusters.yaml (default: the only one). It is fenced for "
        "the drill and declared up again at the end; one already down (a real outage) is refused.",
    },
    "dr_cluster": {
        "default": None, "type": ["null", "string"], "title": "DR cluster",
        "description": "The role: dr cluster that takes over (default: the only one). On backend kubernetes the "
        "run resumes as a gang job there, and with serving.target kubernetes or kserve the endpoint is served on its "
        "inference pool (dr.serving); with serving.target local, by a model server on the Airflow worker.",
    },
    "endpoint": {
        "default": None, "type": ["null", "string"], "title": "Critical endpoint",
        "description": "The endpoint served from its replicated model (default: the only one replicated).",
    },
    "run_key": {
        "default": None, "type": ["null", "string"], "title": "Critical run",
        "description": "The run resumed from its replicated checkpoint (default: the only one replicated).",
    },
    "workers": {
        "default": 1, "type": "integer", "minimum": 1, "title": "Training workers",
        "description": "Gang size of the resumed run on the DR cluster (minimum scale: 1); on Kubernetes at most "
        "the GPUs of one of its node pools.",
    },
    "extra_steps": {
        "default": 20, "type": "integer", "minimum": 1, "title": "Steps to train",
        "description": "How many steps the resumed run trains beyond its replicated checkpoint.",
    },
    "inference_rto_s": {
        "default": DEFAULT_INFERENCE_RTO_S, "type": "number", "exclusiveMinimum": 0,
        "title": "Target: inference RTO (s)", "description": "Declared down -> the DR side answers a prediction.",
    },
    "training_rto_s": {
        "default": DEFAULT_TRAINING_RTO_S, "type": "number", "exclusiveMinimum": 0,
        "title": "Target: training RTO (s)",
        "description": "Declared down -> the resumed run commits a checkpoint beyond the replicated one.",
    },
    "rpo_steps": {
        "default": None, "type": ["null", "integer"], "title": "Target: training steps lost",
        "description": "At most this many steps behind the primary's newest checkpoint (default: one checkpoint "
        "interval of the run).",
    },
    "dataset_age_s": {
        "default": None, "type": ["null", "number"], "title": "Target: dataset age (s)",
        "description": "The newest replicated dataset version at most this old (default: no target).",
    },
}


def _plan(params: Mapping[str, Any], run_id: str):
    from airflow.sdk.exceptions import AirflowFailException

    from hybridflow.config import load_estate
    from hybridflow.dr.drills.drill import make_plan
    from hybridflow.dr.drills.report import DrillError, drill_id
    from hybridflow.settings import get_settings

    settings = get_settings()
    estate = load_estate(settings.config_dir)
    try:
        return make_plan(estate, drill_id(run_id), params), estate, settings
    except DrillError as exc:
        raise AirflowFailException(f"dr drill: {exc}") from exc


def _step(fn: Callable[..., dict], params: Mapping[str, Any], run_id: str, **kwargs: Any) -> dict[str, Any]:
    from airflow.sdk.exceptions import AirflowFailException

    from hybridflow.dr.drills.report import DrillError, DrillMissed

    plan, estate, settings = _plan(params, run_id)
    try:
        return fn(plan, estate, settings, **kwargs)
    except (DrillError, DrillMissed) as exc:  # no retry: the input or the figures, not a hiccup
        raise AirflowFailException(str(exc)) from exc


def declare_task(params: Mapping[str, Any], run_id: str, by: str | None = None) -> dict[str, Any]:
    from hybridflow.dr.drills.drill import declare

    return _step(declare, params, run_id, by=by)


def take_over_task(params: Mapping[str, Any], run_id: str) -> dict[str, Any]:
    from hybridflow.dr.drills.drill import take_over

    report = _step(take_over, params, run_id)
    if report.get("status") == "failed":
        raise RuntimeError(f"the takeover failed: {report.get('error')}; fail_back runs next either way")
    return report


def fail_back_task(params: Mapping[str, Any], run_id: str, by: str | None = None) -> dict[str, Any]:
    from hybridflow.dr.drills.drill import fail_back

    return _step(fail_back, params, run_id, by=by)


def judge_task(params: Mapping[str, Any], run_id: str) -> dict[str, Any]:
    from hybridflow.dr.drills.drill import finish

    return _step(finish, params, run_id)
