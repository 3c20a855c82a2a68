"""Budgets: config errors an operator can act on, one notification per threshold and month through a
real webhook, freezing at 100 % and what a freeze refuses, and lifting it."""

from __future__ import annotations

import json
import shutil
import threading
from datetime import UTC, date, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from hybridflow.admission import admit
from hybridflow.budgets.config import load_budgets, period_end, period_of
from hybridflow.budgets.enforce import refuse_if_frozen
from hybridflow.budgets.evaluate import evaluate_period
from hybridflow.budgets.notifier import BudgetWebhookNotifier
from hybridflow.budgets.store import BudgetStore
from hybridflow.config import load_estate
from hybridflow.errors import AdmissionError, ConfigError
from hybridflow.settings import REPO_ROOT

AT = datetime(2026, 12, 20, 3, 0, tzinfo=UTC)
PERIOD = "2026-12"


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", folder)
    return folder


@pytest.fixture
def store(tmp_path: Path) -> BudgetStore:
    store = BudgetStore(create_engine(f"sqlite:///{tmp_path / 'ledger.db'}"))
    store.ensure_schema()
    return store


def _write_budgets(config_dir: Path, body: str) -> None:
    (config_dir / "budgets.yaml").write_text(body)


# -- config ---------------------------------------------------------------------------------------
def test_budget_file_gives_a_budget_per_project_and_month():
    estate = load_estate(REPO_ROOT / "config")
    cfg = load_budgets(estate.config_dir, estate)
    assert cfg.budget_for("digits-ocr", "2026-12") == 25000  # the month's own budget
    assert cfg.budget_for("digits-ocr", "2027-01") == 20000  # the monthly default
    assert cfg.notify_at == [0.8]
    assert period_of(date(2026, 12, 31)) == "2026-12" and period_end("2026-12") == date(2027, 1, 1)


def test_unknown_project_names_the_file_the_key_and_the_projects_there_are(config_dir):
    _write_budgets(config_dir, "projects:\n  digits-ocr: {monthly_usd: 10}\n  rankin: {monthly_usd: 5}\n")
    estate = load_estate(config_dir)
    with pytest.raises(ConfigError) as err:
        load_budgets(config_dir, estate)
    msg = str(err.value)
    assert f"{config_dir / 'budgets.yaml'}: projects.rankin: unknown project 'rankin'" in msg
    assert "digits-ocr, ranking" in msg and "add it to projects.yaml" in msg


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("projects:\n  ranking: {monthly_usd: -5}\n", "projects.ranking.monthly_usd: Input should be greater than 0"),
        ("projects:\n  ranking: {monthly_usd: 5, months: {'2026-13': 4}}\n", "month keys are YYYY-MM"),
        ("projects:\n  ranking: {monthly: 5}\n", "projects.ranking.monthly: unknown key"),
        ("notify_at: [1.2]\n", "notify_at[0]: Input should be less than 1"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(config_dir, body, expected):
    _write_budgets(config_dir, body)
    with pytest.raises(ConfigError, match="budgets.yaml") as err:
        load_budgets(config_dir, load_estate(config_dir))
    assert expected in str(err.value)


def test_no_budget_file_means_no_project_is_budgeted(config_dir):
    (config_dir / "budgets.yaml").unlink()
    assert load_budgets(config_dir, load_estate(config_dir)).projects == {}


# -- notifications through a real webhook ---------------------------------------------------------
class _Receiver(BaseHTTPRequestHandler):
    received: list[dict]

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.received.append({"body": body, "key": self.headers.get("Idempotency-Key")})
        status = 503 if self.server.fail else 200
        self.send_response(status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.received, server.fail = [], False
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/hooks/gpu-budget"
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_BUDGET_WEBHOOK", json.dumps({"conn_type": "http", "host": url}))
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _send(note: dict) -> None:
    BudgetWebhookNotifier(
        http_conn_id="hybridflow_budget_webhook", text=note["text"], payload=note, key=note["key"]
    )({})


class _Ledger:
    """Spend so far per project in December, as the nightly allocation would have it."""

    def __init__(self, **spend: float) -> None:
        self.spend = {k.replace("_", "-"): v for k, v in spend.items()}

    def __call__(self, project: str, period: str) -> float:
        assert period == PERIOD
        return self.spend.get(project, 0.0)


def _evaluate(store, estate, ledger, stopped=None, at=AT, period=PERIOD):
    cfg = load_budgets(estate.config_dir, estate)
    stop = (lambda project, reason: stopped.setdefault(project, []).append(reason) or []) if stopped is not None \
        else (lambda project, reason: [])
    return {o.project: o for o in evaluate_period(period, cfg, store, spend=ledger, send=_send,
                                                   stop_gangs=stop, at=at)}


def test_80_percent_notifies_once_per_threshold_and_month_however_often_it_runs(webhook, store):
    estate = load_estate(REPO_ROOT / "config")
    ledger = _Ledger(digits_ocr=20_500.0, ranking=1000.0)  # 82 % of 25,000; 12.5 % of 8,000
    first = _evaluate(store, estate, ledger)
    assert first["digits-ocr"].notified == [0.8] and not first["digits-ocr"].frozen
    assert first["ranking"].notified == []
    for _ in range(3):  # the nightly task cleared and re-run; later nights in the same month
        again = _evaluate(store, estate, ledger)
        assert again["digits-ocr"].notified == []
    assert len(webhook.received) == 1
    got = webhook.received[0]
    assert got["key"] == "budget/digits-ocr/2026-12/0.8"
    assert got["body"]["project"] == "digits-ocr" and got["body"]["threshold"] == 0.8
    assert "20,500.00 USD of 25,000.00 USD for 2026-12 (82%" in got["body"]["text"]
    assert store.get("digits-ocr", PERIOD).notified == (0.8,)


def test_a_failed_post_is_sent_again_by_the_next_evaluation(webhook, store):
    estate = load_estate(REPO_ROOT / "config")
    ledger = _Ledger(digits_ocr=21_000.0)
    webhook.fail = True
    with pytest.raises(Exception, match="503"):
        _evaluate(store, estate, ledger)
    assert store.get("digits-ocr", PERIOD) is None or store.get("digits-ocr", PERIOD).notified == ()
    webhook.fail = False
    assert _evaluate(store, estate, ledger)["digits-ocr"].notified == [0.8]
    assert [r["key"] for r in webhook.received] == ["budget/digits-ocr/2026-12/0.8"] * 2  # the failed one, then the sent one


# -- freezing, what it refuses, lifting -----------------------------------------------------------
def test_100_percent_freezes_and_admit_refuses_normal_and_batch_runs_saying_how_to_lift_it(
    webhook, store, tmp_path
):
    estate = load_estate(REPO_ROOT / "config")
    stopped: dict = {}
    out = _evaluate(store, estate, _Ledger(digits_ocr=25_010.0), stopped)
    assert out["digits-ocr"].frozen and out["digits-ocr"].notified == [0.8, 1.0]
    assert len(stopped["digits-ocr"]) == 1 and "ranking" not in stopped
    state = store.get("digits-ocr", PERIOD)
    assert state.frozen and state.frozen_at == AT

    for priority in ("normal", "batch"):
        with pytest.raises(AdmissionError) as err:
            refuse_if_frozen("digits-ocr", priority, "", estate, store=store, today=date(2026, 12, 21))
        msg = str(err.value)
        assert msg.startswith("priority: project 'digits-ocr' has spent 25,010.00 USD of its 25,000.00 USD")
        assert 'raise projects.digits-ocr.months."2026-12"' in msg and "lifts by itself on 2027-01-01" in msg
        assert "only a critical run with budget_override set may start" in msg
    # Even an override does not let a normal run in.
    with pytest.raises(AdmissionError, match="^priority: "):
        refuse_if_frozen("digits-ocr", "normal", "release", estate, store=store, today=date(2026, 12, 21))
    with pytest.raises(AdmissionError, match="^budget_override: .*set budget_override to the reason"):
        refuse_if_frozen("digits-ocr", "critical", "  ", estate, store=store, today=date(2026, 12, 21))
    refuse_if_frozen("digits-ocr", "critical", "INC-42 hotfix model", estate, store=store, today=date(2026, 12, 21))
    refuse_if_frozen("ranking", "normal", "", estate, store=store, today=date(2026, 12, 21))  # other project
    # A new month: nothing is frozen for it.
    refuse_if_frozen("digits-ocr", "normal", "", estate, store=store, today=date(2027, 1, 1))

    # Re-running the evaluation keeps the first freeze time and sends nothing more.
    later = datetime(2026, 12, 21, 3, 0, tzinfo=UTC)
    again = _evaluate(store, estate, _Ledger(digits_ocr=25_010.0), stopped, at=later)
    assert again["digits-ocr"].notified == [] and len(webhook.received) == 2
    assert store.get("digits-ocr", PERIOD).frozen_at == state.frozen_at


def test_a_raised_budget_lets_runs_in_at_once_and_the_next_evaluation_lifts_the_freeze(
    webhook, store, config_dir
):
    estate = load_estate(config_dir)
    ledger = _Ledger(digits_ocr=25_010.0)
    _evaluate(store, estate, ledger)
    with pytest.raises(AdmissionError):
        refuse_if_frozen("digits-ocr", "batch", "", estate, store=store, today=date(2026, 12, 21))
    text = (config_dir / "budgets.yaml").read_text().replace('"2026-12": 25000', '"2026-12": 40000')
    _write_budgets(config_dir, text)
    refuse_if_frozen("digits-ocr", "batch", "", estate, store=store, today=date(2026, 12, 21))
    out = _evaluate(store, estate, ledger)
    assert out["digits-ocr"].lifted and not out["digits-ocr"].frozen
    state = store.get("digits-ocr", PERIOD)
    assert not state.frozen and state.lifted_at is not None
    assert "now 40,000.00 USD, above the 25,010.00 USD spent" in state.reason


def test_admit_itself_refuses_a_frozen_project_and_records_nothing(webhook, store, seeded_private, monkeypatch):
    estate = load_estate(REPO_ROOT / "config")
    _evaluate(store, estate, _Ledger(digits_ocr=30_000.0))
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", str(store.engine.url))
    private = seeded_private
    monkeypatch.setattr("hybridflow.budgets.enforce.datetime", _FixedClock)
    with pytest.raises(AdmissionError, match="^priority: project 'digits-ocr' has spent 30,000.00 USD"):
        admit({"project": "digits-ocr"}, estate, private)
    run = admit({"project": "digits-ocr", "priority": "critical", "budget_override": "INC-42"}, estate, private)
    assert run.request.budget_override == "INC-42"
    from hybridflow.records import build_record
    from hybridflow.runs import RunIdentity

    record = build_record(run, RunIdentity("hybrid_training", "manual__hotfix"), {})
    assert record["budget_override"] == "INC-42" and record["priority"] == "critical"
    assert admit({"project": "ranking", "workers": 1}, estate, private).project == "ranking"


class _FixedClock(datetime):
    @classmethod
    def now(cls, tz=None):
        return AT


# -- the nightly task against a ledger ------------------------------------------------------------
def test_nightly_evaluation_reads_the_months_allocation_from_the_ledger(webhook, tmp_path, monkeypatch):
    from sqlalchemy import text

    from hybridflow.budgets.nightly import evaluate_budgets, period_to_evaluate
    from hybridflow.ledger import upgrade
    from hybridflow.settings import Settings

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", url)
    engine = create_engine(url)
    upgrade(engine, "0001")  # a ledger from before the budget tables: the first evaluation migrates it
    rows = [  # November does not count against December; ranking stays under 80 %
        ("2026-11-30", "digits-ocr", 9000.0), ("2026-12-01", "digits-ocr", 12000.0),
        ("2026-12-19", "digits-ocr", 9000.0), ("2026-12-19", "ranking", 100.0),
    ]
    with engine.begin() as conn:
        for day, project, cost in rows:
            conn.execute(text("INSERT INTO allocation (day, project, team, cluster, gpu_model, pricing_class, "
                              "gpu_hours, cost_usd, waste, waste_gpu_hours, preempted_gpu_hours, attempts) "
                              "VALUES (:d, :p, 't', 'onprem-a', 'A100-80GB', 'onprem', 1, :c, false, 0, 0, 1)"),
                         {"d": day, "p": project, "c": cost})

    class Event:
        extra = {"day": "2026-12-19"}

    period = period_to_evaluate({"hybridflow://ledger/allocations": [Event()]}, datetime(2027, 1, 2, tzinfo=UTC))
    assert period == "2026-12"
    assert period_to_evaluate({}, datetime(2027, 1, 2, tzinfo=UTC)) == "2027-01"
    settings = Settings(home=tmp_path, config_dir=REPO_ROOT / "config")
    out = evaluate_budgets(period, settings, at=AT)
    by_project = {p["project"]: p for p in out["projects"]}
    assert by_project["digits-ocr"]["spend_usd"] == 21000.0 and by_project["digits-ocr"]["notified"] == [0.8]
    assert by_project["ranking"]["spend_usd"] == 100.0 and not by_project["ranking"]["notified"]
    assert evaluate_budgets(period, settings, at=AT)["projects"][0]["notified"] == []  # cleared and re-run
    assert len(webhook.received) == 1


def test_nightly_evaluation_without_an_allocation_table_says_what_to_run(tmp_path, monkeypatch):
    from hybridflow.budgets.nightly import evaluate_budgets
    from hybridflow.budgets.spend import LedgerError
    from hybridflow.settings import Settings

    db = tmp_path / "ledger.db"
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", f"sqlite:///{db}")
    with pytest.raises(LedgerError, match="has no 'allocation' table: run the nightly allocation"):
        evaluate_budgets(PERIOD, Settings(home=tmp_path, config_dir=REPO_ROOT / "config"), at=AT)
    assert inspect(create_engine(f"sqlite:///{db}")).get_table_names() == []  # not made a ledger


def test_admit_passes_while_the_ledger_has_no_budget_tables_yet(tmp_path):
    estate = load_estate(REPO_ROOT / "config")
    from hybridflow.ledger import upgrade

    engine = create_engine(f"sqlite:///{tmp_path / 'fresh-ledger.db'}")
    upgrade(engine, "0001")  # a ledger from before the budget tables (admit never migrates it)
    refuse_if_frozen("digits-ocr", "normal", "", estate, store=BudgetStore(engine), today=date(2026, 12, 21))


def test_cli_prints_each_projects_budget_state(store, tmp_path, monkeypatch, capsys):
    from hybridflow.cli import main

    reason = "project 'digits-ocr' has spent 25,010.00 USD of its 25,000.00 USD budget for 2026-12"
    store.record("digits-ocr", PERIOD, budget_usd=25_000, spend_usd=25_010, frozen=True, reason=reason, at=AT)
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", str(store.engine.url))
    assert main(["budgets", "--period", PERIOD]) == 0
    out = json.loads(capsys.readouterr().out)
    by_project = {p["project"]: p for p in out["projects"]}
    assert out["period"] == PERIOD and by_project["digits-ocr"]["frozen"] and by_project["digits-ocr"]["reason"] == reason
    assert by_project["ranking"]["budget_usd"] == 8000 and by_project["ranking"]["spend_usd"] is None
