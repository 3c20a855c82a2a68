"""Seed the digits dataset: scikit-learn's 1,797 handwritten digits, split 80/20, as CSV files."""

from __future__ import annotations

from pathlib import Path

from hybridflow_examples.seeding import copy_suites, write_file

FEATURES = [f"pixel_{i}" for i in range(64)]
LABEL = "label"


def seed(folder: Path) -> Path:
    """Write train.csv, test.csv and the expectation suites into ``folder`` (idempotent)."""
    import numpy as np
    import pandas as pd
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data.astype(np.int64), digits.target, test_size=0.2, random_state=7, stratify=digits.target
    )
    folder = Path(folder)
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        frame = pd.DataFrame(x, columns=FEATURES)
        frame[LABEL] = y.astype(np.int64)
        write_file(folder / f"{split}.csv", frame.to_csv(index=False).encode())
    copy_suites(Path(__file__).parent, folder)
    return folder
