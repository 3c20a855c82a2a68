"""The GPU ledger: run records, attempts, GPU samples, prices, the nightly allocations and queue waits."""

from hybridflow.ledger.engine import default_engine
from hybridflow.ledger.migrate import upgrade
from hybridflow.ledger.queue_waits import QueueWait, queue_wait_history, record_queue_wait
from hybridflow.ledger.runs import ingest_run_record
from hybridflow.ledger.samples import store_samples

__all__ = [
    "QueueWait", "default_engine", "ingest_run_record", "queue_wait_history", "record_queue_wait", "store_samples",
    "upgrade",
]
