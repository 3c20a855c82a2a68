"""Domain errors. Each message names the input, the limit and the fix."""

from __future__ import annotations


class HybridFlowError(Exception):
    """Base class for errors the platform raises on purpose."""


class ConfigError(HybridFlowError):
    """The estate description under config/ is invalid."""


class AdmissionError(HybridFlowError):
    """A run request was refused. ``field`` names the trigger parameter at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class DataValidationError(HybridFlowError):
    """The dataset failed its expectation suite."""


class PlacementError(HybridFlowError):
    """No cluster can take the run."""


class SovereigntyError(HybridFlowError):
    """Restricted data was about to leave private storage."""


class StagingError(HybridFlowError):
    """A staged copy could not be made or verified."""


class GangError(HybridFlowError):
    """A gang job could not be admitted or one of its workers failed."""


class CompressionRefused(HybridFlowError):
    """A compressed model lost more accuracy than allowed."""


class DeploymentError(HybridFlowError):
    """A new model version failed a check (smoke test, gate, a canary step); the previous version keeps
    serving. ``outcome``: what the deployment measured and did up to the failure (the same keys as a
    successful deploy's result, as far as it got), or None when it failed before measuring anything."""

    def __init__(self, message: str, *, outcome: dict | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome
