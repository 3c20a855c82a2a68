"""Scratch folders of finished runs: only a run's checkpoint folder laid out as the product lays it
out, only once its DAG run is known to be over, found through the ledger's runs; removing it is
idempotent and nothing else under scratch is touched."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import create_engine, text

from hybridflow.ledger import upgrade
from hybridflow.reaper.base import Owner
from hybridflow.reaper.scratch import ScratchFinder, ledger_owner
from hybridflow.runs import RunIdentity

DONE = RunIdentity("hybrid_training", "manual__2027-03-01T08:00:00+00:00")
RUNNING = RunIdentity("hybrid_training", "manual__2027-03-01T09:00:00+00:00")
UNKNOWN = RunIdentity("hybrid_training", "manual__never-noted")
NOW = datetime(2027, 3, 1, 12, 0, tzinfo=UTC)


def _run_folder(root, identity: RunIdentity, extra: str | None = None):
    folder = root / "checkpoints" / identity.run_key
    (folder / "step-000000100").mkdir(parents=True)
    (folder / "step-000000100" / "MANIFEST.json").write_text("{}")
    (folder / "attempts").mkdir()
    (folder / "model").mkdir()
    (folder / "model" / "final.pt").write_bytes(b"weights")
    (folder / "result.json").write_text("{}")
    if extra:
        (folder / extra).write_text("not ours")
    return folder


def _ledger(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    upgrade(engine)
    with engine.begin() as conn:
        for ident in (DONE, RUNNING):
            conn.execute(text("INSERT INTO run (run_key, project, dag_id, run_id) VALUES (:k, 'digits', :d, :r)"),
                         {"k": ident.run_key, "d": ident.dag_id, "r": ident.run_id})
    return engine


def test_only_the_finished_run_s_folder_is_found_and_removed(tmp_path):
    scratch = tmp_path / "scratch"
    done = _run_folder(scratch, DONE)
    running = _run_folder(scratch, RUNNING)
    unknown = _run_folder(scratch, UNKNOWN)
    (scratch / "checkpoints" / "someones-folder").mkdir()
    (scratch / "datasets").mkdir()
    asked = []

    def finished(owner: Owner) -> bool | None:
        asked.append(owner)
        return owner.run_id == DONE.run_id

    finder = ScratchFinder("onprem-a", scratch, finished, owner_of=ledger_owner(_ledger(tmp_path)))
    found = finder.find(NOW)
    assert [lo.name for lo in found] == [str(done)]
    assert found[0].owner == Owner(DONE.dag_id, DONE.run_id) and found[0].kind == "scratch"
    assert {o.run_id for o in asked} == {DONE.run_id, RUNNING.run_id}  # the unknown run is never judged

    finder.release(found[0])
    finder.release(found[0])  # already gone
    assert not done.exists() and running.is_dir() and unknown.is_dir()
    assert (scratch / "checkpoints" / "someones-folder").is_dir() and (scratch / "datasets").is_dir()


def test_a_folder_holding_anything_the_product_does_not_write_is_kept(tmp_path):
    scratch = tmp_path / "scratch"
    _run_folder(scratch, DONE, extra="notes.txt")
    finder = ScratchFinder("onprem-a", scratch, lambda owner: True, owner_of=lambda key: Owner("d", "r"))
    assert finder.find(NOW) == []


def test_an_unknown_verdict_keeps_the_folder_and_a_missing_scratch_has_nothing(tmp_path):
    scratch = tmp_path / "scratch"
    _run_folder(scratch, DONE)
    owner = lambda key: Owner(DONE.dag_id, DONE.run_id)  # noqa: E731
    assert ScratchFinder("onprem-a", scratch, lambda o: None, owner_of=owner).find(NOW) == []
    assert ScratchFinder("onprem-a", tmp_path / "nowhere", lambda o: True, owner_of=owner).find(NOW) == []


def test_a_finished_run_s_folder_stays_for_scratch_keep_h_after_its_last_write(tmp_path):
    scratch = tmp_path / "scratch"
    folder = _run_folder(scratch, DONE)
    finder = ScratchFinder("onprem-a", scratch, lambda o: True, owner_of=lambda key: Owner(DONE.dag_id, DONE.run_id),
                           keep=timedelta(hours=24))
    written = datetime.now(UTC)
    assert finder.find(written + timedelta(hours=23)) == []
    found = finder.find(written + timedelta(hours=25))
    assert [lo.name for lo in found] == [str(folder)]
    assert abs((found[0].since - written).total_seconds()) < 60
