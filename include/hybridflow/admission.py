"""Admit a run: check the trigger Params against the estate before anything is staged or started.

``admit`` resolves the model (``config/models.yaml``) and the dataset (``config/datasets.yaml``), takes
the data's classification from the catalogue (a Param may raise it, never lower it), imports the
model's entry points, checks the expectation suites and compares the data's header with the
schema, then probes the Connections of the Kubernetes clusters the run may be placed on
(:mod:`hybridflow.conncheck`), and refuses a run whose staging would take its project past a
storage or transfer quota (:mod:`hybridflow.budgets.quotas`). It writes nothing, so a refused run
leaves no trace to clean up.
Every refusal is an :class:`AdmissionError` naming the Param (or catalogue or cluster key) at fault
and what to change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from hybridflow.budgets.enforce import refuse_if_frozen
from hybridflow.budgets.quotas import refuse_over_quota
from hybridflow.config import Estate
from hybridflow.config.catalogue import CLASSIFICATIONS, rank
from hybridflow.errors import AdmissionError
from hybridflow.gpumem import SHARDINGS, estimate_for
from hybridflow.params import PARAM_DEFAULTS
from hybridflow.request import AdmittedRun, RunRequest

__all__ = ["PARAM_DEFAULTS", "admit"]

_FIELDS = tuple(RunRequest.model_fields)


def admit(
    raw: Mapping[str, Any],
    estate: Estate,
    private_root: Path,
    *,
    team_usage: Mapping[str, int] | None = None,
    file_roots: Sequence[Path] = (),
) -> AdmittedRun:
    """Validate ``raw`` trigger Params against ``estate``; missing Params take their defaults.

    ``team_usage`` (team -> GPUs its gangs hold now) lets ``admission.over_team_cap: refuse`` turn
    away a run that would take its team past ``gpu_cap``; without it only the static cap is checked.
    ``file_roots`` are the folders ``file://`` datasets may live in (pipeline.yaml ``data.file_roots``).
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
    req, model, entry = _resolve_names(req, estate)

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
    _check_memory(req, model.parameters, estate.gpu_types[req.gpu_type].memory_gib, project.max_workers,
                  estate.pipeline.admission.activation_headroom)
    if req.spot_allowed and not req.interruptible:
        raise AdmissionError(
            "spot_allowed",
            "spot capacity can be reclaimed at any time; set interruptible=true or spot_allowed=false",
        )
    if req.must_stay_private and req.cluster_preference == "public":
        raise AdmissionError(
            "cluster_preference",
            f"dataset {req.dataset!r} is restricted and restricted data never leaves private clusters; set "
            "cluster_preference=private or auto",
        )
    _check_team_cap(req, project.team, estate, team_usage)
    _check_price_ceiling(req, estate)
    from hybridflow.datacheck import check_dataset, check_entrypoints, dataset_bytes

    location = check_dataset(entry, private_root, file_roots)
    check_entrypoints(model)
    refuse_over_quota(req, estate, lambda: dataset_bytes(entry, private_root, file_roots))
    admitted = AdmittedRun(**req.model_dump(), team=project.team, dataset_location=location)
    from hybridflow.conncheck import check_connections

    check_connections(admitted, estate)  # refuses only when no cluster the run may use answers
    return admitted


def _resolve_names(req: RunRequest, estate: Estate):
    """Fill the model, dataset, project, classification, regions and hyper-parameters the trigger
    left empty, and check what it named. Returns (request, model entry, dataset entry)."""
    name = req.model or estate.pipeline.defaults.model
    if name is None:
        raise AdmissionError("model", f"name a model of models.yaml: {', '.join(sorted(estate.models.models))} "
                             "(or set defaults.model in pipeline.yaml)")
    try:
        model = estate.models.get(name)
    except KeyError as exc:
        raise AdmissionError("model", str(exc.args[0])) from None
    try:
        entry = estate.datasets.get(req.dataset or model.dataset)
    except KeyError as exc:
        raise AdmissionError("dataset", str(exc.args[0])) from None
    if req.dataset and req.dataset != model.dataset:
        from hybridflow.config.registry import signature_problems

        problems = signature_problems(model, entry.column_types)
        if problems:
            raise AdmissionError("dataset", f"model {name} cannot train on dataset {entry.name}: {problems[0]}; use a "
                                 f"dataset with its columns (its own is {model.dataset})")
    project = req.project or model.project
    if project is None:
        raise AdmissionError("project", f"model {name} names no project in models.yaml; set the project Param "
                             f"to one of: {', '.join(sorted(estate.projects))}")
    return req.model_copy(update={
        "model": name, "dataset": entry.name, "project": project,
        "classification": _classification(req.classification, entry),
        "regions": _regions(req.regions, entry.regions, estate),
        "hyperparameters": _hyperparameters(req.hyperparameters or {}, model),
    }), model, entry


def _classification(raised: str | None, entry) -> str:
    """The data's classification for this run: the catalogue's (restricted when it has none), or a
    stricter one the trigger asked for."""
    own = entry.effective_classification
    if raised is None:
        return own
    if rank(raised) < rank(own):
        stricter = [c for c in CLASSIFICATIONS if rank(c) >= rank(own)]
        raise AdmissionError(
            "classification",
            f"dataset {entry.name!r} is {own} (datasets.yaml{'' if entry.classification else ', unclassified'}); a "
            f"run may raise its classification, never lower it: leave classification empty or use "
            f"{' or '.join(stricter)}",
        )
    return raised


def _regions(asked: list[str] | None, allowed: list[str], estate: Estate) -> list[str]:
    """Where the data may go for this run: the dataset's regions, narrowed by the Param."""
    if not asked:
        return list(allowed)
    known = estate.known_areas()
    for area in asked:
        if area not in known:
            raise AdmissionError("regions", f"unknown region {area!r}; use regions or jurisdictions of clusters.yaml: "
                                 f"{', '.join(known)}")
    if allowed:
        areas_of = {a: {a} | {x for c in estate.clusters.values() if a in c.areas for x in c.areas} for a in asked}
        wider = [a for a in asked if a not in allowed and not (areas_of[a] & set(allowed))]
        if wider:
            raise AdmissionError("regions", f"{', '.join(wider)} is outside what the dataset allows "
                                 f"({', '.join(allowed)}); a run may narrow the regions, never widen them")
    return list(asked)


def _hyperparameters(overrides: Mapping[str, Any], model) -> dict[str, Any]:
    if not isinstance(overrides, Mapping):
        raise AdmissionError("hyperparameters", f"expected an object of name -> value, got {type(overrides).__name__}")
    known = model.hyperparameters
    for name, value in overrides.items():
        spec = known.get(name)
        if spec is None:
            raise AdmissionError("hyperparameters", f"model {model.name} has no hyper-parameter {name!r}; known: "
                                 f"{', '.join(sorted(known)) or 'none'} (models.yaml)")
        if spec.type == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        problem = spec.problem(value)
        if problem:
            raise AdmissionError(f"hyperparameters.{name}", f"{problem}; e.g. {name}={spec.default!r}")
    return {**model.defaults(), **{k: (float(v) if known[k].type == "float" else v) for k, v in overrides.items()}}


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


def _check_memory(req: RunRequest, registered: int, gpu_memory_gib: float, quota: int, headroom: float) -> None:
    """Refuse a gang whose model state cannot fit its GPUs, saying what would fit."""
    params = int(req.model_params_b * 1e9) if req.model_params_b else registered
    est = estimate_for(params, req.train_setting, workers=req.workers, gpu_memory_gib=gpu_memory_gib,
                       headroom=headroom)
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


_EXAMPLES = {"start_by": "2h"}  # Params whose default (None) is no example of a good value


def _parse(raw: Mapping[str, Any]) -> RunRequest:
    # Missing Params take RunRequest's defaults (the API may trigger with a partial conf).
    try:
        return RunRequest.model_validate(dict(raw))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"]
        field = str(loc[0]) if loc else "params"
        msg = err["msg"].removeprefix("Value error, ")
        example = _EXAMPLES.get(field, RunRequest.model_fields[field].default if field in RunRequest.model_fields
                                else None)
        raise AdmissionError(field, f"{msg} (got {raw.get(field)!r}); e.g. {field}={example!r}") from None
