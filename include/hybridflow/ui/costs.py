"""GPU costs and budgets in the Airflow UI: the latest nightly allocation report, each project's
budget state for the month (spend, share, notifications sent, frozen and why, how to lift it), its
storage and transfer usage against its quotas (:mod:`hybridflow.ui.quotas`), the
inference cost per project and model version of the latest allocated day, and per DAG run the cost
of that run and the state of its project's budget.

Mounted on the plugin app of :mod:`hybridflow.ui.runs` under ``/hybridflow/costs``. The overview (every
project's budget and spend, the allocation report) needs read access to the ``gpu_budgets`` DAG's runs;
a run's *Cost & budget* tab needs read access to that run's DAG and shows only that run and its own
project's budget: it exists for the training DAG's runs, whose record is that run's, and answers 404
for any other DAG's run.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, date, datetime
from html import escape
from pathlib import Path
from typing import Any

from hybridflow.budgets.config import FREEZE_AT, period_of
from hybridflow.runs import RunIdentity
from hybridflow.ui.runs import _cell, _kv_table, _page, _read_json

# Where the nightly allocation writes its HTML report, one folder per day: <day>/report.html.
ALLOCATION_REPORTS = Path("reports") / "allocation"
REPORT_FILE = "report.html"
ATTEMPTS_FILE = "attempts.parquet"  # each attempt of the day as allocated, with its run_key
INFERENCE_FILE = "inference.parquet"  # the day's inference cost lines (hybridflow.ledger.inference)
BUDGETS_DAG = "gpu_budgets"
TRAINING_DAG = "hybrid_training"
COST_DAGS = (TRAINING_DAG,)  # the DAGs whose runs write a run record, hence have a cost of their own
URL_PREFIX = "/hybridflow"  # where the plugin mounts the app (plugins/hybridflow_ui.py)

_BUDGET_STYLE = """
.frozen { background: #ffebe9; } .warn { background: #fff8c5; } .bar { display: inline-block; height: .7rem;
background: #0969da; vertical-align: middle; } .bar.over { background: #cf222e; }
iframe { width: 100%; height: 70vh; border: 1px solid #d8dee4; }
"""


def latest_report(private_root: Path) -> tuple[str, Path] | None:
    """(day, path) of the newest allocation report in private storage, if any."""
    base = private_root / ALLOCATION_REPORTS
    days = sorted(p.parent.name for p in base.glob(f"*/{REPORT_FILE}")) if base.is_dir() else []
    return (days[-1], base / days[-1] / REPORT_FILE) if days else None


def inference_lines_of(private_root: Path, day: str) -> list[dict[str, Any]]:
    """The inference cost lines the nightly allocation wrote for ``day`` (empty: none, or not allocated)."""
    import pyarrow.parquet as pq

    path = private_root / ALLOCATION_REPORTS / day / INFERENCE_FILE
    if not path.is_file() or "cost_usd" not in pq.read_schema(path).names:  # a day nothing served
        return []
    return pq.read_table(path).to_pylist()


def render_inference(lines: list[dict[str, Any]], day: str) -> str:
    """Inference cost per project and model version, with the day's total."""
    if not lines:
        return (f"<p class='muted'>Nothing served on {escape(day)}: the serving meter (gpu_metering) sampled no "
                "model version.</p>")
    rows = "".join(
        f"<tr><td>{escape(x['project'])}</td><td>{_cell(x.get('team'))}</td><td>{escape(x['model'])}</td>"
        f"<td>{escape(x['version'])}</td><td>{escape(x['endpoint'])}</td><td>{escape(x['cluster'])}</td>"
        f"<td>{'GPU' if x['unit'] == 'gpu' else escape(x['unit'])}</td><td>{x['unit_hours']:,.2f}</td>"
        f"<td>{x['usd_per_unit_hour']:,.4f}</td><td>{x['cost_usd']:,.2f}</td></tr>"
        for x in lines
    )
    total = sum(x["cost_usd"] for x in lines)
    return ("<table><tr><th>project</th><th>team</th><th>model</th><th>version</th><th>endpoint</th><th>cluster</th>"
            "<th>unit</th><th>unit-hours</th><th>USD/unit-hour</th><th>cost (USD)</th></tr>"
            f"{rows}<tr><th colspan='9'>inference in all</th><th>{total:,.2f}</th></tr></table>")


def budget_rows(config_dir: Path, store, period: str) -> list[dict[str, Any]]:
    """Every budgeted project for ``period``: its budget and, once evaluated, its recorded state."""
    from hybridflow.budgets.config import load_budgets
    from hybridflow.config import load_estate

    estate = load_estate(config_dir)
    cfg = load_budgets(config_dir, estate)
    states = {s.project: s for s in store.all(period)} if store is not None else {}
    rows = []
    for project in sorted(cfg.projects):
        s = states.get(project)
        rows.append({
            "project": project,
            "team": estate.projects[project].team,
            "period": period,
            "budget_usd": cfg.budget_for(project, period),
            "spend_usd": s.spend_usd if s else None,
            "share": s.share if s else None,
            "notified": list(s.notified) if s else [],
            "frozen": bool(s and s.frozen),
            "reason": s.reason if s else None,
            "evaluated_at": s.evaluated_at.isoformat(timespec="seconds") if s else None,
        })
    return rows


def _usd(value: float | None) -> str:
    return _cell(None) if value is None else escape(f"{value:,.2f}")


def _bar(share: float | None) -> str:
    if share is None:
        return _cell(None)
    width = min(share, 1.2) * 100
    over = " over" if share >= FREEZE_AT else ""
    return f"<span class='bar{over}' style='width:{width:.0f}px'></span> {share:.1%}"


def render_budgets(rows: list[dict[str, Any]], period: str) -> str:
    if not rows:
        return "<p class='muted'>No project has a budget: add them to config/budgets.yaml.</p>"
    body = []
    for r in rows:
        css = "frozen" if r["frozen"] else ("warn" if r["notified"] else "")
        state = "frozen" if r["frozen"] else ("not evaluated yet" if r["spend_usd"] is None else "open")
        notified = ", ".join(f"{t:.0%}" for t in r["notified"]) or None
        body.append(
            f"<tr class='{css}'><td>{escape(r['project'])}</td><td>{escape(r['team'])}</td>"
            f"<td>{_usd(r['budget_usd'])}</td><td>{_usd(r['spend_usd'])}</td><td>{_bar(r['share'])}</td>"
            f"<td>{_cell(notified)}</td><td>{state}</td><td>{_cell(r['reason'])}</td>"
            f"<td>{_cell(r['evaluated_at'])}</td></tr>"
        )
    return (
        f"<table><tr><th>project</th><th>team</th><th>budget {escape(period)} (USD)</th><th>spent (USD)</th>"
        "<th>share</th><th>notified at</th><th>state</th><th>why / how to lift</th><th>evaluated</th></tr>"
        + "".join(body) + "</table>"
    )


def render_costs(rows: list[dict[str, Any]], period: str, report: tuple[str, Path] | None, ledger_note: str,
                 *, base: str = URL_PREFIX, heading: str = "GPU costs &amp; budgets",
                 inference: list[dict[str, Any]] | None = None, quotas: list[dict[str, Any]] | None = None) -> str:
    from hybridflow.ui.quotas import render_quotas

    parts = [f"<h1>{heading}</h1><h2>Budgets for {escape(period)}</h2>", render_budgets(rows, period)]
    if ledger_note:
        parts.append(f"<p class='muted'>{escape(ledger_note)}</p>")
    parts.append(f"<h2>Storage and transfer quotas, {escape(period)}</h2>" + render_quotas(quotas or [], period))
    if report:
        parts.append(f"<h2>Inference cost per project and model version, {escape(report[0])}</h2>"
                     + render_inference(inference or [], report[0]))
    parts.append("<h2>Latest allocation report</h2>")
    if report:
        day = escape(report[0])
        parts.append(
            f"<p>Day {day}: <a href='{base}/costs/report/{day}' target='_blank'>open in a new tab</a></p>"
            f"<iframe src='{base}/costs/report/{day}' title='allocation report {day}'></iframe>"
        )
    else:
        parts.append("<p class='muted'>No allocation report yet: the nightly allocation has not run.</p>")
    return _page("GPU costs & budgets", f"<style>{_BUDGET_STYLE}</style>" + "".join(parts))


def _record_days(record: dict) -> list[str]:
    """The UTC days from the run's first training attempt to its record (the days its GPUs were held)."""
    recorded = record.get("recorded_at")
    if not recorded:
        return []
    last = datetime.fromisoformat(recorded).astimezone(UTC).date()
    starts = [datetime.fromisoformat(a["started_at"]).astimezone(UTC).date()
              for a in record.get("train_attempts") or [] if a.get("started_at")]
    first = min([*starts, last])
    return [date.fromordinal(d).isoformat() for d in range(first.toordinal(), last.toordinal() + 1)]


def allocated_attempts(private_root: Path, record: dict) -> list[dict[str, Any]]:
    """The run's attempts as the nightly allocation priced them, from the attempts file of each day
    the run held GPUs; empty while none of those days is allocated."""
    import pyarrow.parquet as pq

    out: list[dict[str, Any]] = []
    for day in _record_days(record):
        path = private_root / ALLOCATION_REPORTS / day / ATTEMPTS_FILE
        if not path.is_file() or "run_key" not in pq.read_schema(path).names:  # a day without attempts
            continue
        out += pq.read_table(path, filters=[("run_key", "==", record["run_key"])]).to_pylist()
    return out


class NotTheRunsRecord(LookupError):
    """The record found under a run's key names another DAG or run: it is not shown as that run's cost."""


def run_cost_view(private_root: Path, config_dir: Path, store, dag_id: str, run_id: str) -> dict[str, Any]:
    """A training run's cost from its record, and its project's budget in the month it was recorded."""
    run_key = RunIdentity(dag_id, run_id).run_key
    record = next((_read_json(p) for p in sorted(private_root.glob(f"records/*/{run_key}.json"))), None)
    if record and (record.get("dag_id"), record.get("run_id")) != (dag_id, run_id):
        raise NotTheRunsRecord(f"the record filed under {run_key} is not {dag_id} / {run_id}'s")
    if not record:
        return {"dag_id": dag_id, "run_id": run_id, "record": None, "budget": None}
    recorded = record.get("recorded_at")
    period = period_of(datetime.fromisoformat(recorded).date() if recorded else datetime.now(UTC).date())
    price, hours = record.get("price_per_gpu_hour"), record.get("gpu_hours")
    budget = next((r for r in budget_rows(config_dir, store, period) if r["project"] == record.get("project")), None)
    return {
        "dag_id": dag_id, "run_id": run_id, "record": record, "period": period, "budget": budget,
        "cost_usd": round(price * hours, 4) if price is not None and hours is not None else None,
        "allocated": allocated_attempts(private_root, record),
        # A pipeline deploy serves the run's model as version run_key, once the run has trained it.
        "inference": version_inference(private_root, run_key, (_record_days(record) or [None])[0]),
    }


def version_inference(private_root: Path, version: str, since: str | None = None) -> list[dict[str, Any]]:
    """The inference cost lines of model version ``version`` (a deploy's run_key) on every allocated day
    from ``since`` (an ISO day) on."""
    import pyarrow.parquet as pq

    base = private_root / ALLOCATION_REPORTS
    out: list[dict[str, Any]] = []
    for path in sorted(base.glob(f"*/{INFERENCE_FILE}")) if base.is_dir() else []:
        if (since and path.parent.name < since) or "version" not in pq.read_schema(path).names:
            continue
        out += pq.read_table(path, filters=[("version", "==", version)]).to_pylist()
    return out


def render_version_inference(lines: list[dict[str, Any]]) -> str:
    if not lines:
        return ("<p class='muted'>No inference cost: no night has allocated a day this run's model version "
                "served on.</p>")
    rows = "".join(
        f"<tr><td>{escape(x['day'])}</td><td>{escape(x['endpoint'])}</td><td>{escape(x['cluster'])}</td>"
        f"<td>{'GPU' if x['unit'] == 'gpu' else escape(x['unit'])}</td><td>{x['unit_hours']:,.2f}</td>"
        f"<td>{x['cost_usd']:,.4f}</td></tr>" for x in lines)
    total = sum(x["cost_usd"] for x in lines)
    return ("<table><tr><th>day</th><th>endpoint</th><th>cluster</th><th>unit</th><th>unit-hours</th>"
            f"<th>cost (USD)</th></tr>{rows}<tr><th colspan='5'>inference in all</th><th>{total:,.4f}</th></tr></table>")


def render_allocated(attempts: list[dict[str, Any]]) -> str:
    if not attempts:
        return ("<p class='muted'>Not allocated yet: gpu_cost_nightly allocates each day once it is over "
                "(hybridflow demo allocates its days at once).</p>")
    rows = "".join(
        f"<tr><td>{_cell(a['day'])}</td><td>{_cell(a.get('attempt') or a.get('try_number'))}</td>"
        f"<td>{_cell(a['cluster'])} / {_cell(a['pricing_class'])}</td><td>{_cell(a['outcome'])}</td>"
        f"<td>{_cell(a['gpu_hours'])}</td><td>{_cell(a.get('mean_util_pct'))}</td>"
        f"<td>{_cell(a.get('effective_gpu_hours'))}</td><td>{_cell(a['usd_per_gpu_hour'])}</td>"
        f"<td>{a['cost_usd']:,.4f}</td><td>{'waste' if a.get('waste') else ''}</td></tr>"
        for a in attempts
    )
    total = sum(a["cost_usd"] for a in attempts)
    return (
        "<table><tr><th>day</th><th>attempt</th><th>cluster / pricing</th><th>outcome</th><th>GPU-hours</th>"
        "<th>mean utilisation (%)</th><th>effective GPU-hours</th><th>USD/GPU-h</th><th>cost (USD)</th><th></th></tr>"
        f"{rows}<tr><th colspan='8'>allocated in all</th><th>{total:,.4f}</th><th></th></tr></table>"
    )


def render_run_cost(view: dict[str, Any], *, base: str = URL_PREFIX) -> str:
    title = f"Cost of {view['dag_id']} / {view['run_id']}"
    parts = [f"<h1>{escape(title)}</h1>"]
    rec = view["record"]
    if not rec:
        parts.append(
            "<p class='muted'>No run record yet: the cost is known once the record step has run. "
            f"Project budgets: <a href='{base}/costs'>GPU costs &amp; budgets</a>.</p>"
        )
        return _page(title, "".join(parts))
    parts.append(_kv_table([
        ("project / team", f"{rec.get('project')} / {rec.get('team')}"),
        ("priority", rec.get("priority")),
        ("cluster / pricing", f"{rec.get('cluster')} / {rec.get('pricing_class')}"),
        ("GPU-hours (every attempt)", rec.get("gpu_hours")),
        ("USD per GPU-hour", rec.get("price_per_gpu_hour")),
        ("cost (USD, before the nightly allocation)", view["cost_usd"]),
        ("budget override", rec.get("budget_override")),
    ]))
    parts.append("<h2>Allocated by the nightly cost allocation</h2>" + render_allocated(view.get("allocated") or []))
    parts.append("<h2>Inference cost of its model version</h2>" + render_version_inference(view.get("inference") or []))
    parts.append(f"<h2>Budget of {escape(str(rec.get('project')))} for {escape(view['period'])}</h2>")
    if view["budget"]:
        parts.append(render_budgets([view["budget"]], view["period"]))
    else:
        parts.append("<p class='muted'>The project has no budget in config/budgets.yaml.</p>")
    parts.append(f"<p><a href='{base}/costs'>All projects and the latest allocation report</a></p>")
    return _page(title, f"<style>{_BUDGET_STYLE}</style>" + "".join(parts))


def render_no_run_cost(dag_id: str, run_id: str, why: str, *, base: str = URL_PREFIX) -> str:
    title = f"Cost of {dag_id} / {run_id}"
    return _page(title, f"<h1>{escape(title)}</h1><p class='muted'>{escape(why)}</p>"
                        f"<p><a href='{base}/costs'>GPU costs &amp; budgets</a></p>")


def _access(authorize: bool) -> tuple[list, list]:
    """Route dependencies: read access to the budgets DAG's runs (overview), to the DAG run (per run)."""
    if not authorize:
        return [], []
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag
    from fastapi import Depends

    return ([Depends(requires_access_dag("GET", DagAccessEntity.RUN, param_dag_id=BUDGETS_DAG))],
            [Depends(requires_access_dag("GET", DagAccessEntity.RUN))])


def current_rows(store, config_dir: Path, period: str) -> tuple[list[dict], str]:
    """The budget rows of ``period`` and a note for the page when the ledger is missing or unreadable."""
    from sqlalchemy.exc import SQLAlchemyError

    note = "" if store is not None else "No ledger yet: budgets are evaluated after the first nightly allocation."
    try:
        return budget_rows(config_dir, store, period), note
    except SQLAlchemyError as exc:  # shown, not hidden: the operator must see the ledger is unreadable
        return budget_rows(config_dir, None, period), f"The ledger could not be read: {exc.__class__.__name__}: {exc}"


def quota_figures(store, config_dir: Path, period: str) -> list[dict[str, Any]]:
    """Each project's storage and transfer figures for ``period`` (empty without a ledger, or when it
    cannot be read: the budgets' note on the page says so)."""
    from sqlalchemy.exc import SQLAlchemyError

    from hybridflow.budgets.quotas import month_figures
    from hybridflow.config import load_estate

    try:
        return month_figures(store.engine if store is not None else None, load_estate(config_dir), period)
    except SQLAlchemyError:
        return []


def add_cost_pages(
    app,
    *,
    private_root: Path | None = None,
    config_dir: Path | None = None,
    store_factory: Callable[[], Any] | None = None,
    today: Callable[[], date] | None = None,
    authorize: bool = True,
    url_prefix: str = URL_PREFIX,
) -> None:
    """Mount the cost pages on the plugin app. ``authorize=False`` only for tests without an api-server."""
    from fastapi import HTTPException
    from fastapi.responses import FileResponse, HTMLResponse
    from sqlalchemy.exc import SQLAlchemyError

    from hybridflow.settings import get_settings

    def paths() -> tuple[Path, Path]:
        s = get_settings()
        return private_root or s.private_root, config_dir or s.config_dir

    def open_store():
        from hybridflow.budgets.enforce import default_store

        return (store_factory or default_store)()

    def period_now() -> str:
        return period_of((today or (lambda: datetime.now(UTC).date()))())

    overview_access, run_access = _access(authorize)

    @app.get("/costs", response_class=HTMLResponse, dependencies=overview_access)
    def costs_page() -> str:
        root, cfg_dir = paths()
        period = period_now()
        store = open_store()
        rows, note = current_rows(store, cfg_dir, period)
        report = latest_report(root)
        return render_costs(rows, period, report, note, base=url_prefix, quotas=quota_figures(store, cfg_dir, period),
                            inference=inference_lines_of(root, report[0]) if report else [])

    @app.get("/api/costs/budgets", dependencies=overview_access)
    def budgets_json() -> dict:
        _, cfg_dir = paths()
        period = period_now()
        rows, note = current_rows(open_store(), cfg_dir, period)
        return {"period": period, "projects": rows, "note": note}

    @app.get("/costs/report/{day}", dependencies=overview_access)
    def report_file(day: str):
        root, _ = paths()
        try:
            date.fromisoformat(day)  # also keeps the path inside the reports folder
        except ValueError:
            raise HTTPException(404, f"{day!r} is not a day (YYYY-MM-DD)") from None
        path = root / ALLOCATION_REPORTS / day / REPORT_FILE
        if not path.is_file():
            raise HTTPException(404, f"no allocation report for {day}")
        return FileResponse(path, media_type="text/html")

    @app.get("/costs/runs/{dag_id}/{run_id:path}", response_class=HTMLResponse, dependencies=run_access)
    def run_cost_page(dag_id: str, run_id: str):
        # Reading a DAG's runs grants that run's cost, never other projects' budgets or the report.
        if dag_id not in COST_DAGS:
            return HTMLResponse(render_no_run_cost(
                dag_id, run_id, f"only {', '.join(COST_DAGS)} runs have a cost of their own; {dag_id} runs do "
                "not. Every project's budget and spend is on the GPU costs & budgets page, for those who may "
                f"read the {BUDGETS_DAG} DAG's runs.", base=url_prefix), status_code=404)
        root, cfg_dir = paths()
        try:
            try:
                view = run_cost_view(root, cfg_dir, open_store(), dag_id, run_id)
            except SQLAlchemyError:  # the cost still shows; the budget column reads "not evaluated yet"
                view = run_cost_view(root, cfg_dir, None, dag_id, run_id)
        except NotTheRunsRecord as exc:
            return HTMLResponse(render_no_run_cost(dag_id, run_id, f"no cost for this run: {exc}.", base=url_prefix),
                                status_code=404)
        return render_run_cost(view, base=url_prefix)
