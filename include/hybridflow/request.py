"""The run request: a training run's trigger Params as one model (defaults equal ``PARAM_DEFAULTS``),
and the admitted run, the request with every default resolved, that travels between tasks as XCom.

Placement, training and the operators read these without going through admission, which checks a
request against the estate (:func:`hybridflow.admission.admit`) and is the only maker of an
:class:`AdmittedRun` from trigger Params.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hybridflow.gpumem import Optimizer, Precision, Sharding, TrainSetting

__all__ = ["AdmittedRun", "RunRequest"]

Classification = Literal["public", "internal", "restricted"]
Priority = Literal["critical", "normal", "batch"]
ClusterPreference = Literal["auto", "private", "public"]
PlacementStrategy = Literal["local_first", "elastic_first"]
Compression = Literal["int8", "fp16", "best"]


class RunRequest(BaseModel):
    """The trigger Params of one training run (defaults equal ``PARAM_DEFAULTS``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(default=None, min_length=1)  # None: pipeline.yaml defaults.model
    dataset: str | None = Field(default=None, min_length=1)  # None: the model's dataset
    project: str | None = Field(default=None, min_length=1)  # None: the model's project
    classification: Classification | None = None  # None: the catalogue's; set only to raise it
    regions: list[str] | None = None  # None: wherever the dataset may go
    hyperparameters: dict[str, Any] | None = None  # overrides of the model's defaults
    workers: int = Field(default=2, ge=1)
    gpu_type: str = Field(default="A100-80GB", min_length=1)
    priority: Priority = "normal"
    interruptible: bool = False
    spot_allowed: bool = False
    cluster_preference: ClusterPreference = "auto"
    placement_strategy: PlacementStrategy = "local_first"
    max_price_per_gpu_hour: float = Field(default=0.0, ge=0, le=1000)  # 0: no ceiling
    start_by: str | None = None  # a duration: place where the gang is expected to start within it
    model_params_b: float = Field(default=0.0, ge=0, le=10_000)  # 0: the model's registered parameters
    precision: Precision = "fp32"
    optimizer: Optimizer = "sgd_momentum"
    sharding: Sharding = "none"
    checkpoint_every_steps: int = Field(default=50, ge=1)
    compression: Compression = "best"  # best: try int8 and fp16, keep the smallest that passes
    deploy: bool = True
    budget_override: str = Field(default="", max_length=500)  # why a critical run may start while frozen

    @field_validator("budget_override", mode="before")
    @classmethod
    def _no_override(cls, value: Any) -> Any:
        return "" if value is None else value  # the trigger form sends null for an empty field

    @field_validator("workers", "checkpoint_every_steps", mode="before")
    @classmethod
    def _no_bool_counts(cls, value: Any) -> Any:
        # bool is an int subclass: workers=true would silently become 1 GPU.
        if isinstance(value, bool):
            raise ValueError("expected a whole number, not true/false")
        return value

    @field_validator("start_by", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        if value in (None, ""):
            return None
        from hybridflow.waits import parse_duration

        parse_duration(value)  # ValueError names the accepted forms
        return str(value).strip()

    @field_validator("model", "dataset", "project", "classification", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value  # the form's cleared text field

    @property
    def train_setting(self) -> TrainSetting:
        """What the GPU memory check estimates with and the gang's ranks train with."""
        return TrainSetting(precision=self.precision, optimizer=self.optimizer, sharding=self.sharding)

    @property
    def must_stay_private(self) -> bool:
        return self.classification == "restricted"

    @property
    def spot_eligible(self) -> bool:
        return self.spot_allowed and self.interruptible

    @property
    def start_by_s(self) -> float | None:
        from hybridflow.waits import parse_duration

        return None if self.start_by is None else parse_duration(self.start_by)


class AdmittedRun(RunRequest):
    """A request that passed admission with every default resolved (model, dataset, project, the data's
    effective classification and allowed regions, the full hyper-parameters), plus the team and the
    dataset's location. Travels between tasks as XCom."""

    team: str
    dataset_location: str

    @property
    def request(self) -> RunRequest:
        return RunRequest(**{name: getattr(self, name) for name in RunRequest.model_fields})

    def to_xcom(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_xcom(cls, data: Mapping[str, Any]) -> AdmittedRun:
        # The pipeline adds its own keys (e.g. run_key) next to ours in the same XCom dict.
        return cls.model_validate({k: v for k, v in data.items() if k in cls.model_fields})
