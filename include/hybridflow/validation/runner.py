"""Running suites in Great Expectations: an in-memory context, suites built from their files, and two
passes per batch (BOOLEAN_ONLY over the suite, SUMMARY for what failed)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from hybridflow.validation.failures import _exception_message
from hybridflow.validation.suites import SuiteError, _check_structure

if TYPE_CHECKING:
    import pandas as pd

# Example values and row indices kept per failed expectation in the JSON report (GX's default).
REPORT_EXAMPLES = 20


def _import_gx():
    # GX logs hundreds of INFO/DEBUG lines while it imports (its public-API registry, its data
    # source registry); an Airflow task logs at INFO, so quieten GX unless someone set its level.
    gx_log = logging.getLogger("great_expectations")
    if gx_log.level == logging.NOTSET:
        gx_log.setLevel(logging.WARNING)
    import great_expectations as gx

    return gx


def _ephemeral_context(gx):
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    # In memory: no files, no docs site, no usage statistics leaving the (private) network, and no
    # progress bars in the task log.
    return gx.get_context(
        mode="ephemeral",
        project_config=DataContextConfig(
            store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
            analytics_enabled=False,
            progress_bars=ProgressBarsConfig(globally=False),
        ),
    )


def _build_suite(gx, raw: dict, where: str):
    """The GX suite for a parsed suite file; SuiteError names the expectation GX refuses.

    Expectations are built one by one because ``gx.ExpectationSuite`` drops an invalid one with
    only a log line, and handed to the constructor at once (``add_expectation`` compares each new
    expectation with all before it: O(n^2)).
    """
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    _check_structure(raw, f"suite {raw.get('name')!r} for {where}" if isinstance(raw, dict) else where)
    expectations = []
    for i, item in enumerate(raw["expectations"]):
        try:
            expectations.append(ExpectationConfiguration(**item).to_domain_obj())
        except Exception as exc:  # noqa: BLE001 - pydantic and GX raise several kinds; all mean "invalid"
            raise SuiteError(
                f"suite {raw['name']!r} for {where}: expectations[{i}] ({item['type']}) is not valid: {_first_line(exc)}"
            ) from None
    return gx.ExpectationSuite(
        name=raw["name"], expectations=expectations, meta=dict(raw.get("meta") or {}), notes=raw.get("notes")
    )


def _nbytes(frame: pd.DataFrame) -> int:
    return int(frame.memory_usage(index=False, deep=False).sum())


def _columns_with_nulls(frame: pd.DataFrame, suite) -> list[str]:
    """Columns that column expectations look at and that hold a null, in the frame's order."""
    import numpy as np

    if not frame.columns.is_unique:
        return []  # frame[name] would be a frame; GX reports the duplicate columns anyway
    wanted = {getattr(e, "column", None) for e in suite.expectations}
    found = []
    for name in frame.columns:
        if name not in wanted:
            continue
        series = frame[name]
        dtype = series.dtype
        if isinstance(dtype, np.dtype) and dtype.kind in "iub":
            continue  # numpy integers and booleans cannot hold a null
        if isinstance(dtype, np.dtype) and dtype.kind == "f":
            # One reduction instead of an isna() mask per column: a NaN anywhere makes the sum NaN
            # (so do +inf and -inf together, which only sends the column apart needlessly).
            has_null = bool(np.isnan(series.to_numpy().sum()))
        else:
            has_null = bool(series.hasnans)
        if has_null:
            found.append(name)
    return found


def _validate(gx, source, asset: str, frame: pd.DataFrame, suite):
    """BOOLEAN_ONLY over the whole suite, then SUMMARY for the failed expectations that can say more."""
    # V1 Validator is what ValidationDefinition.run and Batch.validate build for each run; holding
    # one per batch keeps one batch (GX fingerprints each batch it builds) and its metric cache for
    # both passes, without storing suites and results in the context as ValidationDefinition does.
    from great_expectations.validator.v1_validator import Validator

    batch_definition = source.add_dataframe_asset(name=asset).add_batch_definition_whole_dataframe(name=asset)
    validator = Validator(
        batch_definition=batch_definition, batch_parameters={"dataframe": frame}, result_format="BOOLEAN_ONLY"
    )
    result = validator.validate_expectation_suite(suite)
    columns = set(frame.columns)
    # A missing column or an exception says all there is to say: SUMMARY would only raise again.
    again = [
        r.expectation_config
        for r in result.results
        if not r.success
        and r.expectation_config.kwargs.get("column") in columns | {None}
        and _exception_message(r.exception_info or {}) is None
    ]
    if again:
        validator.result_format = {"result_format": "SUMMARY", "partial_unexpected_count": REPORT_EXAMPLES}
        detail = validator.validate_expectation_suite(
            gx.ExpectationSuite(name=suite.name, expectations=[_fresh(cfg) for cfg in again])
        )
        by_key = {_key(r.expectation_config): r for r in detail.results}
        result.results = [by_key.get(_key(r.expectation_config), r) for r in result.results]
    return result


def _fresh(cfg) -> dict:
    # A configuration that went through a suite carries that suite's expectation id.
    return {"type": cfg.type, "kwargs": dict(cfg.kwargs)}


def _key(cfg) -> str:
    return json.dumps([cfg.type, cfg.kwargs], sort_keys=True, default=str)



def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
