"""Example datasets and models that use only hybridflow's public training contract.

- ``digits``: scikit-learn's 8x8 handwritten digits as CSV files, a small MLP classifier (accuracy),
  checkpointed as one full state from rank 0;
- ``breast_cancer``: scikit-learn's Wisconsin breast-cancer table as Parquet files, a binary classifier
  (ROC AUC), checkpointed sharded from every rank with ``torch.distributed.checkpoint``.

Each has a seeder (``data.seed``), a GX 1.x expectation suite kept with its data, a builder and a
training function; ``config/datasets.yaml`` and ``config/models.yaml`` register them.
"""
