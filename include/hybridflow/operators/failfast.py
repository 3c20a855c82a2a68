"""Turn errors that a retry cannot fix into AirflowFailException, so Airflow skips its retries."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from airflow.sdk.exceptions import AirflowFailException

from hybridflow.errors import (
    AdmissionError,
    CompressionRefused,
    ConfigError,
    DataValidationError,
    PlacementError,
    SovereigntyError,
)

NON_RETRYABLE = (AdmissionError, ConfigError, DataValidationError, SovereigntyError, CompressionRefused, PlacementError)


@contextmanager
def fail_fast() -> Iterator[None]:
    try:
        yield
    except NON_RETRYABLE as exc:
        # Fix the cause (input, data, config), then clear the task: retrying unchanged cannot help.
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc
