"""DR drills in the Airflow UI: every drill's report, newest first, its RTO and RPO figures beside
the targets they were judged against, the verdict, and what was missed.

Mounted on the plugin app of :mod:`hybridflow.ui.runs` under ``/hybridflow/drills``; access needs
read access to the ``dr_drill`` DAG's runs.
"""

from __future__ import annotations

from collections.abc import Callable
from html import escape
from typing import Any

from hybridflow.dr.drills.report import Targets
from hybridflow.ui.runs import _cell, _page

DRILL_DAG = "dr_drill"

_DRILL_STYLE = """
.missed { background: #ffebe9; } .met { background: #e8f6ec; } .open { background: #fff8c5; }
.num { text-align: right; } ul.missed-steps { margin: 0; padding-left: 1.2em; }
"""


def _figure(value: Any, target: Any, unit: str) -> str:
    shown = _cell(None) if value is None else escape(f"{value:.1f} {unit}" if unit == "s" else f"{value} {unit}")
    bound = "" if target is None else f" <span class='muted'>(≤ {escape(f'{target:g}')} {unit})</span>"
    return shown + bound


def _row(report: dict[str, Any]) -> str:
    if report.get("error") and not report.get("declared_at"):
        return (f"<tr class='missed'><td>{escape(str(report.get('drill')))}</td>"
                f"<td colspan='8'>{escape(report['error'])}</td></tr>")
    figures = report.get("figures") or {}
    targets = {**Targets().to_dict(), **(report.get("targets") or {})}
    verdict = report.get("verdict") or "not judged yet"
    css = {"met": "met", "missed": "missed"}.get(verdict, "open")
    missed = report.get("missed") or []
    why = ("<ul class='missed-steps'>" + "".join(f"<li>{escape(m)}</li>" for m in missed) + "</ul>") if missed \
        else _cell(None)
    rpo_target = targets.get("rpo_steps") or report.get("checkpoint_interval_steps")
    return (
        f"<tr class='{css}'><td>{escape(str(report.get('drill')))}</td><td>{_cell(report.get('declared_at'))}</td>"
        f"<td>{escape(str(report.get('primary')))} → {escape(str(report.get('dr_cluster')))}</td>"
        f"<td class='num'>{_figure(figures.get('inference_rto_s'), targets['inference_rto_s'], 's')}</td>"
        f"<td class='num'>{_figure(figures.get('training_rto_s'), targets['training_rto_s'], 's')}</td>"
        f"<td class='num'>{_figure(figures.get('rpo_steps_lost'), rpo_target, 'steps')}</td>"
        f"<td class='num'>{_figure(figures.get('rpo_dataset_age_s'), targets.get('dataset_age_s'), 's')}</td>"
        f"<td>{escape(verdict)}</td><td>{why}</td></tr>"
    )


def render_drills(reports: list[dict[str, Any]], note: str = "") -> str:
    defaults = Targets()
    parts = ["<h1>DR drills</h1>",
             f"<p>Targets unless a drill set its own: inference RTO ≤ {defaults.inference_rto_s:g} s, training RTO "
             f"≤ {defaults.training_rto_s:g} s (from the primary declared down), training steps lost ≤ one "
             "checkpoint interval.</p>"]
    if note:
        parts.append(f"<p class='muted'>{escape(note)}</p>")
    if not reports:
        parts.append(f"<p class='muted'>No drill yet: trigger the {DRILL_DAG} DAG (it also runs every quarter).</p>")
        return _page("DR drills", "".join(parts))
    parts.append("<table><tr><th>drill</th><th>declared down</th><th>primary → DR</th><th>inference RTO</th>"
                 "<th>training RTO</th><th>steps lost</th><th>dataset age</th><th>verdict</th><th>missed</th></tr>"
                 + "".join(_row(r) for r in reports) + "</table>")
    return _page("DR drills", f"<style>{_DRILL_STYLE}</style>" + "".join(parts))


def add_drill_pages(app, *, source: Callable[[], list[dict[str, Any]]] | None = None,
                    authorize: bool = True) -> None:
    """Mount the drills page on the plugin app. ``authorize=False`` only for tests without an api-server."""
    from fastapi.responses import HTMLResponse

    access: list = []
    if authorize:
        from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
        from airflow.api_fastapi.core_api.security import requires_access_dag
        from fastapi import Depends

        access = [Depends(requires_access_dag("GET", DagAccessEntity.RUN, param_dag_id=DRILL_DAG))]

    def read() -> tuple[list[dict[str, Any]], str]:
        if source is not None:
            return source(), ""
        from hybridflow.dr.drills.report import history
        from hybridflow.settings import get_settings

        try:
            return history(get_settings().private_root), ""
        except OSError as exc:  # shown, not hidden: the operator must see private storage is unreadable
            return [], f"Private storage could not be read: {exc.__class__.__name__}: {exc}"

    @app.get("/drills", response_class=HTMLResponse, dependencies=access)
    def drills_page() -> str:
        return render_drills(*read())

    @app.get("/api/drills", dependencies=access)
    def drills_json() -> dict:
        reports, note = read()
        return {"drills": reports, "note": note}
