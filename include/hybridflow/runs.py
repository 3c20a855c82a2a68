"""Run identity and per-run locations.

Every name a run creates (gang job, checkpoint prefix, artefact folder, record) derives from the DAG
run's identity, so a retried or cleared task finds what its earlier try made instead of making a
second copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunIdentity:
    dag_id: str
    run_id: str
    try_number: int = 1
    triggered_by: str = "unknown"

    @property
    def run_key(self) -> str:
        """A short, path- and DNS-safe name that is unique per DAG run."""
        slug = re.sub(r"[^a-z0-9]+", "-", f"{self.dag_id}-{self.run_id}".lower()).strip("-")[:40].strip("-")
        digest = hashlib.sha256(f"{self.dag_id}\0{self.run_id}".encode()).hexdigest()[:10]
        return f"{slug}-{digest}"

    @classmethod
    def from_context(cls, context) -> RunIdentity:
        dag_run = context["dag_run"]
        user = getattr(dag_run, "triggering_user_name", None) or "unknown"
        return cls(
            dag_id=context["dag"].dag_id,
            run_id=context["run_id"],
            try_number=int(context["ti"].try_number or 1),
            triggered_by=str(user),
        )


def run_dir(private_root: Path, run_key: str) -> Path:
    """The run's artefact folder in private storage (reports, models, record)."""
    return private_root / "runs" / run_key


def write_json_atomic(path: Path, body, *, compact: bool = False) -> Path:
    """Write JSON to ``path`` through a temp file and a rename: readers see the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "w") as fh:
            if compact:
                json.dump(body, fh, separators=(",", ":"))
            else:
                json.dump(body, fh, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
