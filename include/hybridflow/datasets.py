"""The datasets the pipeline trains on, as files in private storage.

A dataset is a folder of CSV files: ``train.csv`` and ``test.csv`` with the feature columns and a
``label`` column. The embedded default ships scikit-learn's handwritten-digits set (1,797 8x8 images,
pixel intensities 0..16), written into private storage by :func:`seed_digits`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from hybridflow.errors import AdmissionError

DIGITS_FEATURES = [f"pixel_{i}" for i in range(64)]
LABEL = "label"
SPLITS = ("train", "test")
PRIVATE_SCHEME = "private://"
DIGITS_URI = "private://datasets/digits"


@dataclass(frozen=True)
class DatasetRef:
    uri: str
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def split_path(self, split: str) -> Path:
        return self.path / f"{split}.csv"


def resolve_dataset(uri: str, private_root: Path) -> DatasetRef:
    """Map a dataset URI to its folder in private storage.

    ``private://datasets/digits`` is relative to the private storage root; ``file:///abs/path``
    names a folder directly.
    """
    if uri.startswith(PRIVATE_SCHEME):
        rel = uri[len(PRIVATE_SCHEME) :].strip("/")
        if not rel or ".." in rel.split("/"):
            raise AdmissionError(
                "dataset_uri", f"{uri!r} is not a dataset path; use private://<folder>, e.g. {DIGITS_URI}"
            )
        path = private_root / rel
    elif uri.startswith("file://"):
        path = Path(uri[len("file://") :])
    else:
        raise AdmissionError(
            "dataset_uri",
            f"{uri!r} has an unknown scheme; use private://<folder> (private storage) or file:///<folder>",
        )
    if not path.is_dir():
        raise AdmissionError("dataset_uri", f"{uri!r} does not exist in private storage ({path})")
    missing = [s for s in SPLITS if not (path / f"{s}.csv").is_file()]
    if missing:
        raise AdmissionError(
            "dataset_uri",
            f"{uri!r} has no {', '.join(m + '.csv' for m in missing)}; a dataset folder holds train.csv and test.csv",
        )
    return DatasetRef(uri=uri, path=path)


def seed_digits(private_root: Path) -> DatasetRef:
    """Write the digits set into private storage (idempotent: same bytes every time)."""
    import numpy as np
    import pandas as pd
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data.astype(np.int64), digits.target, test_size=0.2, random_state=7, stratify=digits.target
    )
    folder = private_root / "datasets" / "digits"
    folder.mkdir(parents=True, exist_ok=True)
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        frame = pd.DataFrame(x, columns=DIGITS_FEATURES)
        frame[LABEL] = y.astype(np.int64)
        data = frame.to_csv(index=False).encode()
        target = folder / f"{split}.csv"
        if not target.is_file() or target.read_bytes() != data:
            tmp = target.with_suffix(".csv.part")
            tmp.write_bytes(data)
            tmp.replace(target)
    return DatasetRef(uri=DIGITS_URI, path=folder)


def parse_split(data: bytes):
    """CSV bytes -> (features float32 scaled to 0..1, labels int64)."""
    import numpy as np
    import pandas as pd

    frame = pd.read_csv(io.BytesIO(data))
    x = frame[DIGITS_FEATURES].to_numpy(dtype=np.float32) / 16.0
    y = frame[LABEL].to_numpy(dtype=np.int64)
    return x, y
