"""Scratch folders of finished runs: a run's checkpoint folder on a cluster's scratch filesystem,
``<scratch_dir>/checkpoints/<run_key>/`` (hybridflow.placement.places), once its DAG run is over.

Only folders laid out as the product lays them out are candidates: named like a run key, holding
nothing but checkpoint steps, attempt reports, the final model, the result and partial writes, and
belonging to a run the ledger knows. Anything else under scratch is never looked into, and a folder
whose run is unknown, or not known to be finished, is kept.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine

from hybridflow.reaper.base import Finder, Leftover, Owner

RUNS_FOLDER = "checkpoints"  # under the scratch root: one folder per run key
_RUN_KEY_RE = re.compile(r"^(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?-)?[0-9a-f]{10}$")  # hybridflow.runs.RunIdentity
_STEP_RE = re.compile(r"^step-\d{9}$")
_TOP_FILES = {"result.json"}  # the worker's result (hybridflow.training.context.RESULT_KEY)
_TOP_DIRS = {"attempts", "model"}  # attempt reports and the final model, in the primary place


def ledger_owner(engine: Engine | None = None) -> Callable[[str], Owner | None]:
    """run key -> the DAG run it belongs to, from the ledger's runs (noted as training starts)."""
    from sqlalchemy import select

    from hybridflow.ledger.models import Run

    def owner_of(run_key: str) -> Owner | None:
        from hybridflow.ledger.engine import default_engine

        with (engine or default_engine()).connect() as conn:
            row = conn.execute(select(Run.dag_id, Run.run_id).where(Run.run_key == run_key)).first()
        if row is None or not row.dag_id or not row.run_id:
            return None
        return Owner(row.dag_id, row.run_id)

    return owner_of


def _ours(folder: Path) -> bool:
    """Laid out as a run's checkpoint folder, with nothing in it the product would not write."""
    if folder.is_symlink() or not folder.is_dir() or not _RUN_KEY_RE.match(folder.name):
        return False
    for entry in folder.iterdir():
        name = entry.name
        if entry.is_symlink():
            return False
        if entry.is_dir() and (_STEP_RE.match(name) or name in _TOP_DIRS):
            continue
        if entry.is_file() and (name in _TOP_FILES or (name.startswith(".") and name.endswith(".part"))):
            continue
        return False
    return True


def _last_write(folder: Path) -> datetime:
    """When anything in ``folder`` (the folder included) was last written."""
    newest = folder.stat().st_mtime
    for path in folder.rglob("*"):
        try:
            newest = max(newest, path.lstat().st_mtime)
        except FileNotFoundError:
            continue
    return datetime.fromtimestamp(newest, UTC)


class ScratchFinder(Finder):
    """Checkpoint folders of finished runs on one cluster's scratch filesystem.

    What to pass: ``place``, the cluster's name; ``scratch_dir``, its scratch root as
    ``hybridflow.placement.places.scratch_root(cluster, settings)`` gives it (the folder holding
    ``checkpoints/``, reachable from where the sweep runs); ``finished``, ``finished(owner) -> bool |
    None`` for an :class:`Owner` with only dag_id and run_id (True: the DAG run is over; False or
    None: running or unknown, kept); ``owner_of`` (optional), run key -> Owner, by default the
    ledger's runs (:func:`ledger_owner`); ``keep``, how long a finished run's folder stays after
    its last write (``reaper.scratch_keep_h``): a run cleared soon after it ended still resumes
    from its scratch checkpoints.
    """

    kind = "scratch"

    def __init__(self, place: str, scratch_dir: Path | str, finished: Callable[[Owner], bool | None],
                 owner_of: Callable[[str], Owner | None] | None = None, keep: timedelta = timedelta(0)) -> None:
        self.place, self.root, self.finished, self.keep = place, Path(scratch_dir), finished, keep
        self.owner_of = owner_of or ledger_owner()

    @property
    def runs_dir(self) -> Path:
        return self.root / RUNS_FOLDER

    def find(self, now: datetime) -> list[Leftover]:
        if not self.runs_dir.is_dir():
            return []
        found = []
        for folder in sorted(self.runs_dir.iterdir()):
            if not _ours(folder):
                continue
            last_write = _last_write(folder)
            if now - last_write < self.keep:
                continue
            owner = self.owner_of(folder.name)
            if owner is None or self.finished(owner) is not True:
                continue
            found.append(Leftover(
                self.place, self.kind, str(folder), owner=owner, since=last_write,
                reason=f"checkpoints of {owner.dag_id} / {owner.run_id}, which has finished",
                detail={"run_key": folder.name},
            ))
        return found

    def release(self, leftover: Leftover) -> None:
        """Remove the run's folder; one already gone is not an error."""
        folder = self.runs_dir / leftover.detail["run_key"]
        if folder.is_symlink() or not _RUN_KEY_RE.match(folder.name):
            raise ValueError(f"{folder} is not a run's scratch folder; not removed")
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            if folder.exists():  # a file inside vanished under us; the folder itself must go
                shutil.rmtree(folder)
