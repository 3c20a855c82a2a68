"""Seed the breast-cancer dataset: scikit-learn's Wisconsin diagnostic table (569 rows, 30 float
measurements), split 80/20, as Parquet files. ``malignant`` is 1 for a malignant tumour."""

from __future__ import annotations

import io
from pathlib import Path

from hybridflow_examples.seeding import copy_suites, write_file

LABEL = "malignant"


def feature_names() -> list[str]:
    from sklearn.datasets import load_breast_cancer

    return [name.replace(" ", "_") for name in load_breast_cancer().feature_names]


def seed(folder: Path) -> Path:
    """Write train.parquet, test.parquet and the expectation suites into ``folder`` (idempotent)."""
    import numpy as np
    import pandas as pd
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    data = load_breast_cancer()
    malignant = (data.target == 0).astype(np.int64)  # scikit-learn's class 0 is malignant
    x_train, x_test, y_train, y_test = train_test_split(
        data.data, malignant, test_size=0.2, random_state=11, stratify=malignant
    )
    folder = Path(folder)
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        frame = pd.DataFrame(x.astype(np.float64), columns=feature_names())
        frame[LABEL] = y
        buf = io.BytesIO()
        # Fixed writer settings: the same data gives the same bytes, so a re-seed changes nothing.
        frame.to_parquet(buf, index=False, engine="pyarrow", compression="zstd")
        write_file(folder / f"{split}.parquet", buf.getvalue())
    copy_suites(Path(__file__).parent, folder)
    return folder
