"""Per-project storage and transfer quotas: projects.yaml refuses a quota it cannot read, naming the
key; admission refuses a run whose staging would pass a quota and writes nothing; a project's bytes
held count each object its manifests name once; the nightly count is the same when run again, its
80 % notification goes out once, and the costs page shows the figures beside GPU spend."""

from __future__ import annotations

import shutil
from datetime import UTC, date, datetime
from pathlib import Path

import pytest
import yaml
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from hybridflow.budgets.quotas import GIB
from hybridflow.budgets.storage_usage import held_bytes, owners_from
from hybridflow.config import load_estate
from hybridflow.errors import AdmissionError, ConfigError
from hybridflow.ledger.transfers import Transfer, record_transfer
from hybridflow.settings import REPO_ROOT
from hybridflow.staging.layout import blob_key, manifest_key_for
from hybridflow.storage.manifest import BlobRecord, DatasetManifest, ManifestEntry
from hybridflow.storage.objectstore import LocalObjectStore

DAY = date(2026, 12, 20)
AT = datetime(2026, 12, 21, 3, 0, tzinfo=UTC)


def config_with(tmp_path: Path, edit_projects=None, edit_clusters=None) -> Path:
    target = tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", target)
    for name, edit in (("projects.yaml", edit_projects), ("clusters.yaml", edit_clusters)):
        if edit is not None:
            body = yaml.safe_load((target / name).read_text())
            edit(body)
            (target / name).write_text(yaml.safe_dump(body))
    return target


def _set(key: str, value, project: str = "ranking"):
    return lambda body: body["projects"][project].update({key: value})


@pytest.mark.parametrize(("key", "value", "says"), [
    ("storage_gib", -5, "greater than 0"),
    ("storage_gib", 0, "greater than 0"),
    ("storage_gib", "500GB", "without a unit"),
    ("transfer_gib_per_month", "2 TiB", "without a unit"),
])
def test_a_quota_that_is_not_a_positive_number_of_gib_is_refused_naming_the_key(tmp_path, key, value, says):
    with pytest.raises(ConfigError) as err:
        load_estate(config_with(tmp_path, _set(key, value)), use_cache=False)
    message = str(err.value)
    assert f"projects.ranking.{key}: " in message and says in message and "GiB" in message
    assert f"e.g. {key}: 500" in message


def test_a_misspelt_quota_key_is_refused_with_the_keys_allowed(tmp_path):
    with pytest.raises(ConfigError, match=r"projects\.ranking\.storage_gb: unknown key.*storage_gib"):
        load_estate(config_with(tmp_path, _set("storage_gb", 500)), use_cache=False)


def test_a_negative_egress_price_is_refused_naming_the_cluster_key(tmp_path):
    def edit(body):
        body["clusters"]["cloud-east"]["egress_usd_per_gib"] = -0.09

    with pytest.raises(ConfigError, match=r"clusters\.cloud-east\.egress_usd_per_gib: .*greater than or equal to 0"):
        load_estate(config_with(tmp_path, edit_clusters=edit), use_cache=False)


# -- admission ---------------------------------------------------------------------------------------
@pytest.fixture
def admit_env(tmp_path, seeded_private, monkeypatch):
    """A home with the seeded datasets and a ledger holding 3 GiB staged this month by digits-ocr."""
    root = tmp_path / "home" / "private"
    shutil.copytree(seeded_private, root)
    url = f"sqlite:///{tmp_path / 'home' / 'ledger.db'}"
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", url)
    from hybridflow.ledger import upgrade

    engine = create_engine(url)
    upgrade(engine)
    record_transfer(engine, Transfer(key="staging/cloud-east/digits/v0/r0", day=date.today().replace(day=1),
                                     project="digits-ocr", kind="staging", cluster="cloud-east", bytes=3 * GIB))
    engine.dispose()
    return root


def snapshot(base: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(base.rglob("*"))}


def test_admission_refuses_a_run_whose_staging_would_pass_the_transfer_quota_and_writes_nothing(tmp_path, admit_env):
    from hybridflow.admission import admit

    estate = load_estate(config_with(tmp_path, _set("transfer_gib_per_month", 3, "digits-ocr")), use_cache=False)
    before = snapshot(tmp_path / "home")
    with pytest.raises(AdmissionError) as err:
        admit({"model": "digits-mlp"}, estate, admit_env)
    message = str(err.value)
    assert err.value.field == "cluster_preference"
    assert "has transferred 3.00 GiB in" in message and "staging dataset 'digits' (" in message
    assert "projects.digits-ocr.transfer_gib_per_month = 3 GiB" in message
    assert "wait for next month" in message and "cluster_preference=private" in message
    assert snapshot(tmp_path / "home") == before  # no ledger row, record, run folder or cache touched
    # Kept on private clusters nothing is staged, so the quota does not apply.
    assert admit({"model": "digits-mlp", "cluster_preference": "private"}, estate, admit_env).project == "digits-ocr"


def test_admission_refuses_a_run_past_the_storage_quota_naming_prune(tmp_path, admit_env):
    from hybridflow.admission import admit

    estate = load_estate(config_with(tmp_path, _set("storage_gib", 3.0001, "digits-ocr")), use_cache=False)
    with pytest.raises(AdmissionError, match=r"holds 3\.00 GiB .*projects\.digits-ocr\.storage_gib = 3\.0001 GiB"
                                             r".*hybridflow cache prune --cluster <cluster> --dataset digits"):
        admit({"model": "digits-mlp"}, estate, admit_env)
    roomy = load_estate(config_with(tmp_path / "roomy", _set("storage_gib", 4, "digits-ocr")), use_cache=False)
    assert admit({"model": "digits-mlp"}, roomy, admit_env).project == "digits-ocr"


# -- storage usage -----------------------------------------------------------------------------------
def _manifest(store, dataset: str, files: dict[str, int], run_key: str) -> DatasetManifest:
    entries = [ManifestEntry(path=p, key=blob_key(dataset, p * 32), size=n, sha256=p * 32) for p, n in files.items()]
    blobs = [BlobRecord(key=e.key, size=e.size, sha256=e.sha256) for e in entries]
    m = DatasetManifest(dataset=dataset, entries=tuple(entries), blobs=tuple(blobs), created_by=run_key)
    store.put_bytes(manifest_key_for(dataset, m.version), m.to_json())
    return m


def test_a_blob_shared_by_two_versions_counts_once_and_one_shared_by_two_projects_counts_for_each(tmp_path):
    cache, dr = LocalObjectStore(tmp_path / "cache"), LocalObjectStore(tmp_path / "dr")
    # ranking's two versions share blob "a"; diagnosis's version shares "a" with them.
    v1 = _manifest(cache, "digits", {"a": 1000, "b": 200}, "run-r1")
    v2 = _manifest(cache, "digits", {"a": 1000, "c": 30}, "run-r2")
    v3 = _manifest(cache, "digits", {"a": 1000, "d": 4}, "run-d1")
    d1 = _manifest(dr, "digits", {"a": 1000, "b": 200}, "dr-replication")  # v1 replicated: a second copy
    records = [{"run_key": "run-r1", "project": "ranking"}, {"run_key": "run-r2", "project": "ranking"},
               {"run_key": "run-d1", "project": "diagnosis"},
               # the DR copy's manifest names no run of ours: the record of a run that validated v1 does
               {"run_key": "run-r9", "project": "ranking", "dataset": "digits", "dataset_version": v1.version}]
    held = held_bytes({"cloud-east": cache, "dr-west": dr}, owners_from(records), ["digits"])
    sizes = {m.version: len(m.to_json()) for m in (v1, v2, v3)}
    assert held["ranking"]["cloud-east"] == 1000 + 200 + 30 + sizes[v1.version] + sizes[v2.version]
    assert held["diagnosis"] == {"cloud-east": 1000 + 4 + sizes[v3.version]}
    assert d1.version == v1.version and held["ranking"]["dr-west"] == 1000 + 200 + len(d1.to_json())
    # A version no record or staging ties to a project shows as unattributed, not as nothing.
    _manifest(cache, "digits", {"e": 5}, "run-unknown")
    assert held_bytes({"cloud-east": cache}, owners_from(records), ["digits"])["unattributed"]["cloud-east"] > 5


# -- the nightly count, its notification, the costs page ---------------------------------------------
@pytest.fixture
def nightly(tmp_path, monkeypatch):
    def clusters(body):
        body["clusters"]["cloud-east"].update(storage_usd_per_gib_month=0.023 * 31, egress_usd_per_gib=0.09)

    cfg = config_with(tmp_path, _set("storage_gib", 1.0, "ranking"), clusters)
    home = tmp_path / "home"
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(home))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(cfg))
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", url)
    from hybridflow.records import write_record

    write_record(home / "private", {"run_key": "run-r1", "project": "ranking"})
    cache = LocalObjectStore(tmp_path / "cache")
    _manifest(cache, "digits", {"a": int(0.85 * GIB)}, "run-r1")  # 85 % of ranking's 1 GiB
    from hybridflow.ledger.engine import default_engine

    record_transfer(default_engine(), Transfer(key="staging/cloud-east/digits/v/run-r1", day=DAY, project="ranking",
                                               kind="staging", cluster="cloud-east", bytes=2 * GIB))
    return {"cloud-east": cache}, url, cfg


def test_the_nightly_count_is_the_same_when_run_again_and_notifies_at_80_percent_once(nightly):
    from hybridflow.budgets.quota_nightly import record_quota_usage

    stores, url, _ = nightly
    sent: list[dict] = []
    first = record_quota_usage(DAY, stores=stores, send=sent.append, at=AT)
    again = record_quota_usage(DAY, stores=stores, send=sent.append, at=AT)
    with create_engine(url).connect() as conn:
        rows = conn.execute(text("SELECT project, storage_bytes, transfer_bytes_month, storage_usd, transfer_usd "
                                 "FROM quota_usage WHERE day = '2026-12-20' ORDER BY project")).all()
    assert first["projects"] == again["projects"] and len(rows) == len(first["projects"])
    ranking = next(r for r in rows if r[0] == "ranking")
    assert ranking[2] == 2 * GIB and ranking[4] == pytest.approx(2 * 0.09)  # egress priced per GiB moved
    assert ranking[3] == pytest.approx(ranking[1] / GIB * 0.023)  # a month's storage price / 31 days
    assert [n["key"] for n in sent] == ["quota/ranking/2026-12/storage_gib/0.8"]
    assert "holds 0.85 GiB of its storage_gib of 1 GiB" in sent[0]["text"]
    assert first["notified"] == ["quota/ranking/2026-12/storage_gib/0.8"] and again["notified"] == []
    # Past 100 % the next night sends the 100 % notification (the 80 % one went out already this month).
    _manifest(stores["cloud-east"], "digits", {"b": int(0.2 * GIB)}, "run-r1")
    record_quota_usage(date(2026, 12, 21), stores=stores, send=sent.append, at=AT)
    assert [n["key"] for n in sent][1:] == ["quota/ranking/2026-12/storage_gib/1"]
    assert "runs whose staging needs more are refused" in sent[1]["text"]


def test_the_costs_page_shows_storage_and_transfer_beside_gpu_spend(nightly, tmp_path):
    from hybridflow.budgets.quota_nightly import record_quota_usage
    from hybridflow.budgets.store import BudgetStore
    from hybridflow.ui.costs import add_cost_pages

    stores, url, cfg = nightly
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO allocation (day, project, team, cluster, gpu_model, pricing_class, gpu_hours, "
                          "cost_usd, waste, waste_gpu_hours, preempted_gpu_hours, attempts) VALUES ('2026-12-19', "
                          "'ranking', 'search', 'cloud-east', 'H100-80GB', 'on_demand', 10, 39.0, 0, 0, 0, 1)"))
    record_quota_usage(DAY, stores=stores, send=lambda note: None, at=AT)
    app = FastAPI()
    add_cost_pages(app, private_root=tmp_path / "home" / "private", config_dir=cfg,
                   store_factory=lambda: BudgetStore(engine), today=lambda: DAY, authorize=False)
    html = TestClient(app).get("/costs").text
    assert "Storage and transfer quotas, 2026-12" in html
    row = html[html.index("<tr class='warn'><td>ranking</td>"):]
    row = row[:row.index("</tr>")]
    assert "<td>39.00</td>" in row and "0.85 of 1 GiB" in row and "85.0%" in row
    assert "2.00 GiB (no quota)" in row and "storage_gib: 80%" in row and "<td>open</td>" in row


# -- what moved ----------------------------------------------------------------------------------------
def test_a_stage_and_a_replication_pass_are_counted_once_however_often_their_task_runs(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from hybridflow.dr.replication.replicas import SetOutcome
    from hybridflow.dr.replication.usage import record_replicated
    from hybridflow.ledger.transfers import transferred_bytes
    from hybridflow.placement.stage import record_staged
    from hybridflow.records import write_record

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", url)
    staged = SimpleNamespace(dataset="digits", version="v1", bytes_copied=5 * GIB)
    for _ in range(2):  # the stage task cleared and run again
        record_staged("run-r1", "ranking", "cloud-east", staged)
    # v1 validated by runs of two projects: the pass's bytes are shared between them, not counted twice.
    for run_key, project in (("run-r1", "ranking"), ("run-d1", "diagnosis")):
        write_record(tmp_path / "private", {"run_key": run_key, "project": project, "dataset": "digits",
                                            "dataset_version": "v1"})
    report = SimpleNamespace(cluster="dr-west", sets=[SetOutcome("dataset", "digits", "v1", "copied", 2, 3000)])
    assert record_replicated(report, tmp_path / "private", DAY) == 2
    assert record_replicated(report, tmp_path / "private", DAY) == 0
    engine = create_engine(url)
    moved = transferred_bytes(engine, since=date.min, until=date.max)
    assert moved == {"ranking": 5 * GIB + 1500, "diagnosis": 1500}
    assert transferred_bytes(engine, since=date.min, until=date.max, kinds=("staging",)) == {"ranking": 5 * GIB}


def test_bytes_the_gateway_served_count_once_for_the_project_that_deployed_the_version(nightly, tmp_path):
    from hybridflow.budgets.quota_nightly import record_quota_usage, record_served
    from hybridflow.ledger.engine import default_engine
    from hybridflow.serving.egress import EgressCounter, served_bytes

    stores, url, _ = nightly
    serving = tmp_path / "home" / "state" / "serving"
    evening = datetime(DAY.year, DAY.month, DAY.day, 23, 59, tzinfo=UTC)
    for _ in range(2):  # a gateway started again adds to what the first one wrote
        gateway = EgressCounter(serving)
        gateway.add("digits", "run-r1", 3 * 2**20, when=evening)
        gateway.add("digits", "run-unknown", 100, when=evening)
        gateway.flush()
    assert served_bytes(serving, DAY) == {("digits", "run-r1"): 6 * 2**20, ("digits", "run-unknown"): 200}
    # The day still being served is left for a later night: a transfer is recorded once.
    assert record_served(DAY, serving, default_engine(), tmp_path / "home" / "private", today=DAY) == 0
    for _ in range(2):
        record_quota_usage(DAY, stores=stores, send=lambda note: None, at=AT)
    with create_engine(url).connect() as conn:
        served = conn.execute(text("SELECT project, bytes FROM transfer WHERE kind = 'serving' ORDER BY project")).all()
        month = conn.execute(text("SELECT transfer_bytes_month FROM quota_usage WHERE project = 'ranking' "
                                  "AND day = '2026-12-20'")).scalar()
    assert served == [("ranking", 6 * 2**20), ("unattributed", 200)]
    assert month == 2 * GIB + 6 * 2**20  # staged and served out, this month
