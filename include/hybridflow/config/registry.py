"""The model registry (``config/models.yaml``): the training contract's other half.

A data team registers a model by name::

    models:
      churn:
        entrypoint: churn_model.train:train       # train(ctx), called in every rank of the gang
        build: churn_model.train:build            # build(hparams) -> torch.nn.Module, to load the weights
        dataset: churn                            # the catalogue entry a run trains on by default
        project: retention                        # the project a run bills to by default
        target: churned                           # the dataset column the metric is scored against
        hyperparameters:
          steps: {type: int, default: 500, min: 1}
          learning_rate: {type: float, default: 0.01, min: 0}
        metric: {name: roc_auc, direction: higher, gate: 0.8, max_drop: 0.01}
        signature:
          inputs: [{name: "f_{0..29}", type: float}]
          output: {name: churn_probability, type: probability}
        parameters: 12000                         # for the GPU memory check at admission (optional)
        serving: {endpoint: churn}                # the endpoint name (default: the model's name)

Both functions must be importable where they run: from the environment here, from the training and
serving images on Kubernetes. ``build`` receives the run's hyper-parameters and returns the module
whose ``state_dict`` the training function saved with ``ctx.save_model``; the module takes the
signature's inputs as one float32 tensor ``[n, len(inputs)]`` in the order listed and returns
class scores ``[n, classes]`` (output type ``class``), one logit per row (``probability``, served as
its sigmoid) or one value per row (``value``).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from hybridflow.config.base import _Model
from hybridflow.config.catalogue import expand_names
from hybridflow.errors import ConfigError

MODELS_FILE = "models.yaml"

HyperparameterType = Literal["int", "float", "bool", "string"]
OutputType = Literal["class", "probability", "value"]
Direction = Literal["higher", "lower"]
_ENTRYPOINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")

# Metric -> (the direction that is better, the output types it can score).
METRICS: dict[str, tuple[Direction, tuple[str, ...]]] = {
    "accuracy": ("higher", ("class", "probability")),
    "f1": ("higher", ("class", "probability")),
    "roc_auc": ("higher", ("probability",)),
    "log_loss": ("lower", ("probability",)),
    "mse": ("lower", ("value", "probability")),
    "rmse": ("lower", ("value", "probability")),
    "mae": ("lower", ("value", "probability")),
    "r2": ("higher", ("value",)),
}


class Hyperparameter(_Model):
    type: HyperparameterType
    default: Any
    min: float | None = None
    max: float | None = None
    choices: list[Any] | None = None
    description: str = ""

    @model_validator(mode="after")
    def _default_fits(self) -> Hyperparameter:
        problem = self.problem(self.default)
        if problem:
            raise ValueError(f"default {self.default!r}: {problem}")
        return self

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not acceptable, or None."""
        kind = self.type
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, int | float) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "string": isinstance(value, str),
        }[kind]
        if not ok:
            return f"expected {'a whole number' if kind == 'int' else 'a number' if kind == 'float' else kind}, got {type(value).__name__}"
        if self.min is not None and value < self.min:
            return f"{value!r} is below the minimum {self.min:g}"
        if self.max is not None and value > self.max:
            return f"{value!r} is above the maximum {self.max:g}"
        if self.choices is not None and value not in self.choices:
            return f"{value!r} is not one of {self.choices}"
        return None


class MetricSpec(_Model):
    name: str
    direction: Direction | None = None  # default: the metric's own (accuracy higher, mse lower, ...)
    gate: float  # evaluate stops the run when the held-out score is on the wrong side of this
    max_drop: float = Field(default=0.02, ge=0)  # compress refuses a variant that loses more than this

    @model_validator(mode="after")
    def _known(self) -> MetricSpec:
        if self.name not in METRICS:
            raise ValueError(f"unknown metric {self.name!r}; use one of: {', '.join(METRICS)}")
        better = METRICS[self.name][0]
        if self.direction is not None and self.direction != better:
            raise ValueError(f"{self.name} is better when {better}; set direction: {better} or remove it")
        return self

    @property
    def better(self) -> Direction:
        return self.direction or METRICS[self.name][0]

    def passes(self, value: float) -> bool:
        return value >= self.gate if self.better == "higher" else value <= self.gate

    def drop(self, baseline: float, value: float) -> float:
        """How much worse ``value`` is than ``baseline`` (negative: better)."""
        return round(baseline - value if self.better == "higher" else value - baseline, 10)


class InputColumn(_Model):
    name: str = Field(min_length=1)  # may be a {a..b} range of columns
    type: Literal["float", "int", "bool"] = "float"
    min: float | None = None
    max: float | None = None


class OutputSpec(_Model):
    name: str = Field(min_length=1)
    type: OutputType
    classes: int | None = Field(default=None, ge=2)  # class outputs: how many scores the model returns

    @model_validator(mode="after")
    def _classes(self) -> OutputSpec:
        if self.type == "class" and self.classes is None:
            raise ValueError("output type class needs classes: <number of classes>")
        if self.type != "class" and self.classes is not None:
            raise ValueError(f"classes is only used with output type class, not {self.type}")
        return self


class Signature(_Model):
    inputs: list[InputColumn] = Field(min_length=1)
    output: OutputSpec

    @property
    def input_columns(self) -> list[tuple[str, InputColumn]]:
        return [(name, col) for col in self.inputs for name in expand_names(col.name)]

    @property
    def input_names(self) -> list[str]:
        return [name for name, _ in self.input_columns]


class ServingSpec(_Model):
    endpoint: str | None = Field(default=None, min_length=1)


class ModelEntry(_Model):
    entrypoint: str
    build: str
    dataset: str = Field(min_length=1)
    target: str = Field(min_length=1)
    project: str | None = Field(default=None, min_length=1)  # a run's project when its trigger names none
    hyperparameters: dict[str, Hyperparameter] = Field(default_factory=dict)
    metric: MetricSpec
    signature: Signature
    parameters: int = Field(default=0, ge=0)  # for the GPU memory check; 0: small enough not to matter
    serving: ServingSpec = ServingSpec()
    description: str = ""
    owner: str | None = None

    _name: str = ""

    @model_validator(mode="after")
    def _fits(self) -> ModelEntry:
        for key in ("entrypoint", "build"):
            if not _ENTRYPOINT.match(getattr(self, key)):
                raise ValueError(f"{key} {getattr(self, key)!r} must be 'package.module:function'")
        if self.signature.output.type not in METRICS[self.metric.name][1]:
            raise ValueError(
                f"metric {self.metric.name} cannot score a {self.signature.output.type} output; use one of the "
                "metrics for it: " + ", ".join(m for m, (_, kinds) in METRICS.items()
                                               if self.signature.output.type in kinds)
            )
        return self

    @property
    def name(self) -> str:
        return self._name

    @property
    def endpoint(self) -> str:
        return self.serving.endpoint or self.name

    def defaults(self) -> dict[str, Any]:
        return {k: h.default for k, h in self.hyperparameters.items()}

    def card(self) -> dict[str, Any]:
        """What a trained model carries with it (model bundles, run records): enough to load and serve it."""
        return {
            "model": self.name, "build": self.build, "target": self.target,
            "metric": self.metric.model_dump(mode="json"),
            "signature": self.signature.model_dump(mode="json"),
        }


@dataclass(frozen=True)
class Registry:
    path: Path
    models: dict[str, ModelEntry]

    def get(self, name: str) -> ModelEntry:
        try:
            return self.models[name]
        except KeyError:
            raise KeyError(
                f"model {name!r} is not in {self.path.name}; use one of: {', '.join(sorted(self.models))} "
                "(or register it there)"
            ) from None


class ModelsFile(_Model):
    models: dict[str, ModelEntry] = Field(default_factory=dict)


def parse_registry(path: Path, datasets: Mapping[str, Any], projects: Mapping[str, Any]) -> Registry:
    from hybridflow.config.reading import _validate

    if not path.is_file():
        return Registry(path=path, models={})  # nothing registered: every model is unknown
    parsed = _validate(ModelsFile, path, allow_empty=True)
    problems = []
    for name, entry in parsed.models.items():
        at = f"{path}: models.{name}"
        if not _NAME_RE.match(name):
            problems.append(f"{at}: model names use lowercase letters, numbers and '-' (they name endpoints)")
        if not _NAME_RE.match(entry.serving.endpoint or name):
            problems.append(f"{at}.serving.endpoint: use lowercase letters, numbers and '-'")
        if entry.project is not None and entry.project not in projects:
            problems.append(f"{at}.project: {entry.project!r} is not in projects.yaml; use one of: "
                            f"{', '.join(sorted(projects))}")
        dataset = datasets.get(entry.dataset)
        if dataset is None:
            problems.append(f"{at}.dataset: {entry.dataset!r} is not in datasets.yaml; use one of: "
                            f"{', '.join(sorted(datasets))}")
            continue
        try:
            problems += [f"{at}.{p}" for p in signature_problems(entry, dataset.column_types)]
        except ValueError as exc:
            problems.append(f"{at}.signature: {exc}")
    if problems:
        raise ConfigError("invalid model registry:\n" + "\n".join(f"  - {p}" for p in problems))
    for name, entry in parsed.models.items():
        entry._name = name
    return Registry(path=path, models=dict(parsed.models))


def signature_problems(entry: ModelEntry, columns: Mapping[str, str]) -> list[str]:
    """Why ``entry`` cannot be trained on a dataset with these columns (name -> type), if at all."""
    problems = []
    names = entry.signature.input_names
    missing = [n for n in names if n not in columns]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        problems.append(f"signature.inputs: the dataset has no column {shown}; name its columns")
    wrong = [n for n in names if columns.get(n) == "string"]
    if wrong:
        problems.append(f"signature.inputs: {', '.join(wrong[:5])} hold text; inputs are numbers")
    if entry.target not in columns:
        problems.append(f"target: the dataset has no column {entry.target!r}; use one of its columns")
    elif entry.target in names:
        problems.append(f"target: {entry.target!r} is also an input; the model must not see its answer")
    return problems


# -- entrypoints: resolved where they run ------------------------------------------------------------
class EntrypointError(Exception):
    """An entrypoint does not import or does not take the arguments the platform passes."""


def resolve(ref: str, *, argument: str = "ctx") -> Callable[..., Any]:
    """Import ``package.module:function`` and check it takes one positional argument (``ctx`` for a
    training function, ``hparams`` for a builder); EntrypointError says what is wrong and the fix."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to see
        raise EntrypointError(
            f"{ref}: module {module_name!r} does not import ({type(exc).__name__}: {exc}); install the package "
            "in this environment (and in the training and serving images for Kubernetes)"
        ) from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise EntrypointError(f"{ref}: {module_name} has no function {attr!r}; check the name after ':'")
    try:
        signature = inspect.signature(fn)
    except ValueError:
        return fn  # builtins without a signature: trust them
    try:
        signature.bind(None)
    except TypeError as exc:
        raise EntrypointError(
            f"{ref}: {attr}{signature} cannot be called with one argument ({exc}); define it as "
            f"def {attr}({argument}): ..."
        ) from None
    return fn
