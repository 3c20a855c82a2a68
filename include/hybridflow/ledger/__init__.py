"""The GPU ledger: run records, attempts, GPU samples, prices and the nightly allocations."""

from hybridflow.ledger.engine import default_engine
from hybridflow.ledger.migrate import upgrade
from hybridflow.ledger.runs import ingest_run_record
from hybridflow.ledger.samples import store_samples

__all__ = ["default_engine", "ingest_run_record", "store_samples", "upgrade"]
