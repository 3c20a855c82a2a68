"""A drill's report: what each step measured, the targets, and the verdict.

RTO (recovery time) is measured from the moment the primary was declared down: to the first
prediction the disaster-recovery side answered (inference), and to the first checkpoint the resumed
training committed beyond the replicated one (training stepping). RPO (recovery point) is the
training steps lost (the primary's newest committed checkpoint at the declaration, less the step
the DR side resumed from) and the age of the newest dataset version in the DR store.

Each drill's report is one JSON file in private storage, ``<private_root>/drills/<drill_id>.json``,
rewritten atomically by every step (so a step cleared and run again replaces its own part); the
history is every such file, newest first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridflow.errors import HybridFlowError

DRILLS_DIR = "drills"
DEFAULT_INFERENCE_RTO_S = 60.0
DEFAULT_TRAINING_RTO_S = 120.0
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


class DrillError(HybridFlowError):
    """A drill could not be run as asked: the input at fault and the fix are named, nothing changed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class DrillMissed(HybridFlowError):
    """The drill ran but missed a target; the message names each step that took too long."""


@dataclass(frozen=True)
class Targets:
    """What a drill must meet. ``rpo_steps`` None: one checkpoint interval of the drilled run."""

    inference_rto_s: float = DEFAULT_INFERENCE_RTO_S
    training_rto_s: float = DEFAULT_TRAINING_RTO_S
    rpo_steps: int | None = None
    dataset_age_s: float | None = None  # no target unless given

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Targets:
        """From the drill's Params, each checked: a bad one is a DrillError naming it."""
        def number(name: str, default: float | None, kind=float):
            value = params.get(name)
            if value is None or value == "":
                return default
            try:
                out = kind(value)
            except (TypeError, ValueError):
                raise DrillError(name, f"{value!r} is not a number; give e.g. {default or 60}") from None
            if out <= 0:
                raise DrillError(name, f"{value!r} must be positive")
            return out

        return cls(inference_rto_s=number("inference_rto_s", DEFAULT_INFERENCE_RTO_S),
                   training_rto_s=number("training_rto_s", DEFAULT_TRAINING_RTO_S),
                   rpo_steps=number("rpo_steps", None, int), dataset_age_s=number("dataset_age_s", None))


def drill_id(run_id: str) -> str:
    """A file-safe id from the DAG run's id (the same for every step and retry of one drill)."""
    return _SAFE.sub("_", run_id).strip("_")[:120] or "drill"


def report_path(private_root: Path, drill: str) -> Path:
    return Path(private_root) / DRILLS_DIR / f"{drill}.json"


def read_report(private_root: Path, drill: str) -> dict[str, Any]:
    try:
        return json.loads(report_path(private_root, drill).read_text())
    except FileNotFoundError:
        return {}


def update_report(private_root: Path, drill: str, **parts: Any) -> dict[str, Any]:
    """Merge ``parts`` into the drill's report and write it atomically; the whole report back."""
    from hybridflow.runs import write_json_atomic

    report = {**read_report(private_root, drill), "drill": drill, **parts}
    write_json_atomic(report_path(private_root, drill), report)
    return report


def history(private_root: Path, limit: int = 200) -> list[dict[str, Any]]:
    """Every drill's report, newest declaration first; an unreadable file is shown as such."""
    out = []
    for path in (Path(private_root) / DRILLS_DIR).glob("*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            out.append({"drill": path.stem, "error": f"unreadable report: {exc}"})
    out.sort(key=lambda r: str(r.get("declared_at") or ""), reverse=True)
    return out[:limit]


def measure(report: Mapping[str, Any]) -> dict[str, Any]:
    """RTO and RPO figures from the timestamps and steps the steps recorded (None where a step did
    not get that far)."""
    declared = report.get("declared_ts")
    inference = report.get("inference") or {}
    training = report.get("training") or {}

    def since(ts: Any) -> float | None:
        return None if ts is None or declared is None else round(float(ts) - float(declared), 3)

    primary_step = report.get("primary_step")
    resumed = training.get("resumed_step")
    lost = None if primary_step is None or resumed is None else max(0, int(primary_step) - int(resumed))
    return {"inference_rto_s": since(inference.get("healthy_ts")),
            "training_rto_s": since(training.get("stepping_ts")),
            "rpo_steps_lost": lost,
            "rpo_dataset_age_s": (report.get("dataset") or {}).get("age_s")}


def judge(report: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(figures, what was missed): each miss names the step and its figure against the target."""
    figures = measure(report)
    targets = {**Targets().to_dict(), **(report.get("targets") or {})}
    rpo_target = targets.get("rpo_steps") or report.get("checkpoint_interval_steps")
    missed = []
    for step, key, target, unit in (
            ("inference: serving the replicated model on the DR cluster", "inference_rto_s",
             targets["inference_rto_s"], "s"),
            ("training: resuming from the replicated checkpoint on the DR cluster", "training_rto_s",
             targets["training_rto_s"], "s")):
        value = figures[key]
        if value is None:
            missed.append(f"{step}: never got there ({key} not measured; see the take_over task's log)")
        elif value > target:
            missed.append(f"{step}: took {value:.1f} {unit} after the declaration, target {key} <= {target:g} {unit}")
    lost = figures["rpo_steps_lost"]
    if lost is not None and rpo_target is not None and lost > int(rpo_target):
        missed.append(f"replication of checkpoints: {lost} training steps lost, target rpo_steps <= {int(rpo_target)} "
                      "(one checkpoint interval)")
    age, age_target = figures["rpo_dataset_age_s"], targets.get("dataset_age_s")
    if age is not None and age_target is not None and age > age_target:
        missed.append(f"replication of datasets: the newest DR dataset version is {age:.0f} s old, target "
                      f"dataset_age_s <= {age_target:g}")
    return figures, missed
