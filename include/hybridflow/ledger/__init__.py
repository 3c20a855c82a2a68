"""The GPU ledger: run records, attempts, GPU samples, prices and the nightly allocations."""

from hybridflow.ledger.engine import default_engine
from hybridflow.ledger.migrate import upgrade
from hybridflow.ledger.samples import store_samples

__all__ = ["default_engine", "store_samples", "upgrade"]
