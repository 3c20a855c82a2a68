"""The resource reaper in the Airflow UI: the last sweep as the ledger holds it (when it ran, whether
each place was in dry-run, what was released or would have been, the GPU-hours that stopped, and
what failed or could not be swept).

Mounted on the plugin app of :mod:`hybridflow.ui.runs` under ``/hybridflow/reaper``; access needs
read access to the reaper DAG's runs.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from html import escape
from typing import Any

from hybridflow.ui.runs import _cell, _page

REAPER_DAG = "resource_reaper"

_REAPER_STYLE = """
.failed { background: #ffebe9; } .dry { background: #fff8c5; } .done { background: #e8f6ec; }
.num { text-align: right; }
"""


def _when(ts: datetime | None) -> str:
    return _cell(None) if ts is None else escape(ts.isoformat(timespec="seconds"))


def _hours(value: float) -> str:
    return escape(f"{value:,.2f}")


def _owner(owner: dict | None) -> str:
    if not owner:
        return _cell(None)
    parts = [owner["dag_id"], owner["run_id"]]
    if owner.get("task_id"):
        parts.append(owner["task_id"] + (f" (try {owner['try_number']})" if owner.get("try_number") else ""))
    return escape(" / ".join(str(p) for p in parts))


def _outcome(row: dict[str, Any]) -> tuple[str, str]:
    """(row class, what happened) of one release."""
    if row["released"]:
        return "done", "released"
    if row["error"]:
        return "failed", f"failed: {escape(row['error'])}"
    return "dry", "would release (dry-run)"


def render_places(sweep: dict[str, Any]) -> str:
    names = sorted(set(sweep["places"]) | set(sweep["errors"]))
    if not names:
        return "<p class='muted'>Nothing was found in any place.</p>"
    body = []
    for name in names:
        p = sweep["places"].get(name)
        error = sweep["errors"].get(name)
        mode = _cell(None) if p is None else ("dry-run" if p["dry_run"] else "releasing")
        counts = (p["released"], p["listed"], p["failed"]) if p else (0, 0, 0)
        css = "failed" if error or (p and p["failed"]) else ""
        body.append(f"<tr class='{css}'><td>{escape(name)}</td><td>{mode}</td>"
                    + "".join(f"<td class='num'>{n}</td>" for n in counts)
                    + f"<td>{_cell(error)}</td></tr>")
    return ("<table><tr><th>place</th><th>mode</th><th>released</th><th>would release</th><th>failed</th>"
            "<th>could not be swept</th></tr>" + "".join(body) + "</table>")


def render_rows(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p class='muted'>No leftovers: nothing to release.</p>"
    body = []
    for r in rows:
        css, what = _outcome(r)
        body.append(
            f"<tr class='{css}'><td>{escape(r['place'])}</td><td>{escape(r['kind'])}</td><td>{escape(r['name'])}</td>"
            f"<td>{_owner(r['owner'])}</td><td class='num'>{r['gpus']}</td><td class='num'>{_hours(r['gpu_hours'])}</td>"
            f"<td>{_when(r['since'])}</td><td>{what}</td><td>{_cell(r['reason'] or None)}</td></tr>"
        )
    return ("<table><tr><th>place</th><th>kind</th><th>name</th><th>owner (DAG / run / task)</th><th>GPUs</th>"
            "<th>GPU-hours</th><th>since</th><th>outcome</th><th>why</th></tr>" + "".join(body) + "</table>")


def render_reaper(sweep: dict[str, Any] | None, note: str = "") -> str:
    parts = ["<h1>Resource reaper</h1>"]
    if note:
        parts.append(f"<p class='muted'>{escape(note)}</p>")
    if sweep is None:
        if not note:
            parts.append(f"<p class='muted'>No sweep yet: the {REAPER_DAG} DAG has not recorded one.</p>")
        return _page("Resource reaper", "".join(parts))
    parts.append(
        f"<h2>Last sweep: {escape(sweep['key'])}</h2>"
        f"<p>Started {_when(sweep['started'])}, finished {_when(sweep['finished'])}. "
        f"Released {sweep['released']}, would release {sweep['listed']} (dry-run), failed {sweep['failed']}, "
        f"kept {sweep['kept']} (owner alive or not judged).</p>"
        f"<p>GPU-hours stopped: <b>{_hours(sweep['gpu_hours_stopped'])}</b>; "
        f"would stop in dry-run places: {_hours(sweep['gpu_hours_would_stop'])}.</p>"
        "<h2>Places</h2>" + render_places(sweep) + "<h2>Leftovers</h2>" + render_rows(sweep["rows"])
    )
    return _page("Resource reaper", f"<style>{_REAPER_STYLE}</style>" + "".join(parts))


def _jsonable(sweep: dict[str, Any] | None) -> dict[str, Any] | None:
    if sweep is None:
        return None

    def iso(ts: datetime | None) -> str | None:
        return None if ts is None else ts.isoformat()

    rows = [{**r, "since": iso(r["since"])} for r in sweep["rows"]]
    return {**sweep, "started": iso(sweep["started"]), "finished": iso(sweep["finished"]), "rows": rows}


def add_reaper_pages(app, *, sweep_source: Callable[[], dict[str, Any] | None] | None = None,
                     authorize: bool = True) -> None:
    """Mount the reaper page on the plugin app. ``authorize=False`` only for tests without an api-server."""
    from fastapi.responses import HTMLResponse

    access: list = []
    if authorize:
        from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
        from airflow.api_fastapi.core_api.security import requires_access_dag
        from fastapi import Depends

        access = [Depends(requires_access_dag("GET", DagAccessEntity.RUN, param_dag_id=REAPER_DAG))]

    def read() -> tuple[dict[str, Any] | None, str]:
        from sqlalchemy.exc import SQLAlchemyError

        if sweep_source is None:
            from hybridflow.reaper.records import last_sweep as source
        else:
            source = sweep_source
        try:
            return source(), ""
        except SQLAlchemyError as exc:  # shown, not hidden: the operator must see the ledger is unreadable
            return None, f"The ledger could not be read: {exc.__class__.__name__}: {exc}"

    @app.get("/reaper", response_class=HTMLResponse, dependencies=access)
    def reaper_page() -> str:
        return render_reaper(*read())

    @app.get("/api/reaper/last", dependencies=access)
    def reaper_json() -> dict:
        sweep, note = read()
        return {"sweep": _jsonable(sweep), "note": note}
