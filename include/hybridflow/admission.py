"""Admit a run: check the trigger Params against the estate before anything is staged or started.

``admit`` is pure: it reads the config and checks that the dataset folder exists, and writes nothing,
so a refused run leaves no trace to clean up. Every refusal is an :class:`AdmissionError` naming the
Param at fault and what to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hybridflow.budgets.enforce import refuse_if_frozen
from hybridflow.config import Estate
from hybridflow.datasets import resolve_dataset
from hybridflow.errors import AdmissionError
from hybridflow.gpumem import SHARDINGS, Optimizer, Precision, Sharding, estimate
from hybridflow.params import PARAM_DEFAULTS

__all__ = ["PARAM_DEFAULTS", "AdmittedRun", "RunRequest", "admit"]

Sensitivity = Literal["public", "internal", "restricted"]
Priority = Literal["critical", "normal", "batch"]
ClusterPreference = Literal["auto", "private", "public"]
PlacementStrategy = Literal["local_first", "elastic_first"]
Compression = Literal["int8", "fp16", "best"]
# The pipeline's built-in model (hybridflow.training.model, hidden=128): 64*128+128 + 128*64+64 + 64*10+10.
BUILTIN_MODEL_PARAMS = 17_226


class RunRequest(BaseModel):
    """The trigger Params of one training run (defaults equal ``PARAM_DEFAULTS``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    project: str = Field(default="digits-ocr", min_length=1)
    dataset_uri: str = Field(default="private://datasets/digits", min_length=1)
    sensitivity: Sensitivity = "internal"
    workers: int = Field(default=2, ge=1)
    gpu_type: str = Field(default="A100-80GB", min_length=1)
    priority: Priority = "normal"
    interruptible: bool = False
    spot_allowed: bool = False
    cluster_preference: ClusterPreference = "auto"
    placement_strategy: PlacementStrategy = "local_first"
    max_price_per_gpu_hour: float = Field(default=0.0, ge=0, le=1000)  # 0: no ceiling
    model_params_b: float = Field(default=0.0, ge=0, le=10_000)  # 0: the pipeline's built-in model
    precision: Precision = "fp32"
    optimizer: Optimizer = "sgd_momentum"
    sharding: Sharding = "none"
    train_steps: int = Field(default=300, ge=1, le=100_000)
    checkpoint_every_steps: int = Field(default=50, ge=1)
    compression: Compression = "best"  # best: try int8 and fp16, keep the smallest that passes
    deploy: bool = True
    budget_override: str = Field(default="", max_length=500)  # why a critical run may start while frozen

    @field_validator("budget_override", mode="before")
    @classmethod
    def _no_override(cls, value: Any) -> Any:
        return "" if value is None else value  # the trigger form sends null for an empty field

    @field_validator("workers", "train_steps", "checkpoint_every_steps", mode="before")
    @classmethod
    def _no_bool_counts(cls, value: Any) -> Any:
        # bool is an int subclass: workers=true would silently become 1 GPU.
        if isinstance(value, bool):
            raise ValueError("expected a whole number, not true/false")
        return value

    @property
    def must_stay_private(self) -> bool:
        return self.sensitivity == "restricted"

    @property
    def spot_eligible(self) -> bool:
        return self.spot_allowed and self.interruptible


class AdmittedRun(RunRequest):
    """A request that passed admission, plus what admission resolved. Travels between tasks as XCom."""

    team: str
    dataset_path: str

    @property
    def request(self) -> RunRequest:
        return RunRequest(**{name: getattr(self, name) for name in RunRequest.model_fields})

    def to_xcom(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_xcom(cls, data: Mapping[str, Any]) -> AdmittedRun:
        # The pipeline adds its own keys (e.g. run_key) next to ours in the same XCom dict.
        return cls.model_validate({k: v for k, v in data.items() if k in cls.model_fields})


_FIELDS = tuple(RunRequest.model_fields)


def admit(
    raw: Mapping[str, Any],
    estate: Estate,
    private_root: Path,
    *,
    team_usage: Mapping[str, int] | None = None,
) -> AdmittedRun:
    """Validate ``raw`` trigger Params against ``estate``; missing Params take their defaults.

    ``team_usage`` (team -> GPUs its gangs hold now) lets ``admission.over_team_cap: refuse`` turn
    away a run that would take its team past ``gpu_cap``; without it only the static cap is checked.
    """
    if not isinstance(raw, Mapping):
        raise AdmissionError("params", f"expected a mapping of Param name to value, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in RunRequest.model_fields)
    if unknown:
        raise AdmissionError(
            unknown[0],
            f"unknown parameter(s) {', '.join(unknown)}; remove them. Known parameters: {', '.join(_FIELDS)}",
        )
    req = _parse(raw)

    project = estate.projects.get(req.project)
    if project is None:
        raise AdmissionError(
            "project",
            f"unknown project {req.project!r}; use one of: {', '.join(sorted(estate.projects))} "
            f"(or add it to projects.yaml)",
        )
    refuse_if_frozen(req.project, req.priority, req.budget_override, estate)
    if req.workers > project.max_workers:
        raise AdmissionError(
            "workers",
            f"{req.workers} workers exceeds project {req.project!r}'s quota of {project.max_workers} GPUs per run; "
            f"ask for at most {project.max_workers} (or raise projects.{req.project}.max_workers)",
        )
    if req.gpu_type not in estate.gpu_types:
        raise AdmissionError(
            "gpu_type",
            f"unknown GPU type {req.gpu_type!r}; use one of: {', '.join(sorted(estate.gpu_types))}",
        )
    offered = estate.offered_gpu_models()
    if req.gpu_type not in offered:
        raise AdmissionError(
            "gpu_type",
            f"no cluster has {req.gpu_type} GPUs; use one of the models on offer: {', '.join(offered)}",
        )
    _check_memory(req, estate.gpu_types[req.gpu_type].memory_gib, project.max_workers,
                  estate.pipeline.admission.activation_headroom)
    if req.spot_allowed and not req.interruptible:
        raise AdmissionError(
            "spot_allowed",
            "spot capacity can be reclaimed at any time; set interruptible=true or spot_allowed=false",
        )
    if req.must_stay_private and req.cluster_preference == "public":
        raise AdmissionError(
            "cluster_preference",
            "restricted data never leaves private clusters; set cluster_preference=private or auto "
            "(or lower sensitivity if the data is not restricted)",
        )
    _check_team_cap(req, project.team, estate, team_usage)
    _check_price_ceiling(req, estate)
    if req.checkpoint_every_steps > req.train_steps:
        raise AdmissionError(
            "checkpoint_every_steps",
            f"{req.checkpoint_every_steps} is more than train_steps={req.train_steps}, so no checkpoint would "
            f"ever be written; set it to at most {req.train_steps}",
        )
    dataset = resolve_dataset(req.dataset_uri, private_root)
    return AdmittedRun(**req.model_dump(), team=project.team, dataset_path=str(dataset.path))


def _check_team_cap(req: RunRequest, team_name: str, estate: Estate, usage: Mapping[str, int] | None) -> None:
    cap = estate.teams[team_name].gpu_cap
    if cap is None:
        return
    if req.workers > cap:
        raise AdmissionError(
            "workers",
            f"{req.workers} workers exceeds team {team_name!r}'s gpu_cap of {cap} GPUs, so the gang could never "
            f"start; ask for at most {cap} (or raise teams.{team_name}.gpu_cap in projects.yaml)",
        )
    if usage is None or req.priority == "critical" or estate.pipeline.admission.over_team_cap != "refuse":
        return
    held = int(usage.get(team_name, 0))
    if held + req.workers > cap:
        raise AdmissionError(
            "priority",
            f"team {team_name!r} holds {held} of its gpu_cap of {cap} GPUs, {req.workers} more would pass it and "
            f"admission.over_team_cap is refuse; trigger again when the team's runs finish, ask for at most "
            f"{max(cap - held, 0)} workers, or use priority=critical for urgent work",
        )


def _check_price_ceiling(req: RunRequest, estate: Estate) -> None:
    """A ceiling below every pool the run could use is a mistake in the form: say the cheapest option."""
    ceiling = req.max_price_per_gpu_hour
    if not ceiling:
        return
    prices = [
        c.price_of(p)
        for c in estate.clusters.values()
        for p in c.node_pools
        if p.gpu_model == req.gpu_type
        and (c.is_private or not req.must_stay_private)
        and req.cluster_preference in ("auto", c.location)
        and (not p.spot or req.spot_eligible)
    ]
    if prices and min(prices) > ceiling:
        raise AdmissionError(
            "max_price_per_gpu_hour",
            f"{ceiling:g} USD/GPU-hour is below every {req.gpu_type} pool this run may use (cheapest "
            f"{min(prices):.2f}); raise it to at least {min(prices):.2f}, or set 0 for no ceiling",
        )


def _check_memory(req: RunRequest, gpu_memory_gib: float, quota: int, headroom: float) -> None:
    """Refuse a gang whose model state cannot fit its GPUs, saying what would fit."""
    params = int(req.model_params_b * 1e9) if req.model_params_b else BUILTIN_MODEL_PARAMS
    est = estimate(params, precision=req.precision, optimizer=req.optimizer, sharding=req.sharding,
                   workers=req.workers, gpu_memory_gib=gpu_memory_gib, headroom=headroom)
    if est.fits:
        return
    options = []
    n = est.min_workers()
    if n is not None and n <= quota:
        options.append(f"workers={n}")
    for s in SHARDINGS[SHARDINGS.index(req.sharding) + 1 :]:
        m = est.min_workers(s)
        if m is not None and m <= max(quota, req.workers):
            options.append(f"sharding={s}" + ("" if m <= req.workers else f" with workers={m}"))
    field = "workers" if options and options[0].startswith("workers=") else "sharding"
    if not options:
        half = "" if req.precision != "fp32" else "; bf16 halves weights and gradients"
        raise AdmissionError(
            "model_params_b",
            f"does not fit: {est.explain()}. Even sharding zero3 over the project's quota of {quota} "
            f"{req.gpu_type} GPUs is not enough; use a GPU type with more memory or a smaller model{half}",
        )
    raise AdmissionError(
        field,
        f"does not fit: {est.explain()}. What fits within the quota of {quota} GPUs: {' or '.join(options)}",
    )


def _parse(raw: Mapping[str, Any]) -> RunRequest:
    # Missing Params take RunRequest's defaults (the API may trigger with a partial conf).
    try:
        return RunRequest.model_validate(dict(raw))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"]
        field = str(loc[0]) if loc else "params"
        msg = err["msg"].removeprefix("Value error, ")
        example = RunRequest.model_fields[field].default if field in RunRequest.model_fields else None
        raise AdmissionError(field, f"{msg} (got {raw.get(field)!r}); e.g. {field}={example!r}") from None
