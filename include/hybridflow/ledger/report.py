"""The day's allocation as an HTML page with inline SVG charts: cost by project over time,
utilisation against allocation, the top waste, and inference cost per project and model version."""

from __future__ import annotations

import html
import io
from datetime import date, timedelta

from sqlalchemy import Engine, func, select

from hybridflow.ledger.models import Allocation

REPORT_FILE = "report.html"
HISTORY_DAYS = 30
TOP_WASTE = 10

_STYLE = """body { font: 14px system-ui, sans-serif; margin: 1.5rem; color: #1f2328; }
table { border-collapse: collapse; margin: .5rem 0 1.5rem; } td, th { border: 1px solid #d8dee4; padding: .25rem .6rem; }
td.n { text-align: right; font-variant-numeric: tabular-nums; } .kpi { display: inline-block; margin-right: 2rem; }
.kpi b { display: block; font-size: 1.4rem; } svg { max-width: 100%; height: auto; }"""


def _svg(fig) -> str:
    buf = io.StringIO()
    # No timestamp, fixed element ids: re-running a day writes the same page.
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _cost_history(engine: Engine, day: date) -> dict[str, dict[str, float]]:
    start = (day - timedelta(days=HISTORY_DAYS - 1)).isoformat()
    with engine.connect() as conn:
        rows = conn.execute(
            select(Allocation.day, Allocation.project, func.sum(Allocation.cost_usd))
            .where(Allocation.day >= start, Allocation.day <= day.isoformat())
            .group_by(Allocation.day, Allocation.project)
        ).all()
    out: dict[str, dict[str, float]] = {}
    for d, project, usd in rows:
        out.setdefault(project, {})[d] = float(usd)
    return out


def _charts(engine: Engine, day: date, rows: list[dict], costs) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "hybridflow-allocation"
    import matplotlib.pyplot as plt

    charts = []
    days = [(day - timedelta(days=i)).isoformat() for i in range(HISTORY_DAYS - 1, -1, -1)]
    history = _cost_history(engine, day)
    fig, ax = plt.subplots(figsize=(9, 3.2))
    bottom = [0.0] * len(days)
    for project, by_day in sorted(history.items()):
        values = [by_day.get(d, 0.0) for d in days]
        ax.bar(range(len(days)), values, bottom=bottom, label=project)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(0, len(days), 5), [d[5:] for d in days[::5]])
    ax.set_ylabel("USD / day")
    if history:
        ax.legend(fontsize=8, loc="upper left")
    charts.append(("Cost by project, last 30 days", _svg(fig)))
    plt.close(fig)

    by_project: dict[str, list[float]] = {}
    for r in rows:
        acc = by_project.setdefault(r["project"], [0.0, 0.0])
        acc[0] += r["gpu_hours"]
        acc[1] += r["effective_gpu_hours"] or 0.0
    fig, ax = plt.subplots(figsize=(9, 3.2))
    names = sorted(by_project)
    ax.barh([i + 0.2 for i in range(len(names))], [by_project[n][0] for n in names], 0.4, label="allocated")
    ax.barh([i - 0.2 for i in range(len(names))], [by_project[n][1] for n in names], 0.4, label="effective (used)")
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("GPU-hours")
    ax.legend(fontsize=8)
    charts.append(("Utilisation against allocation", _svg(fig)))
    plt.close(fig)
    return charts


def _table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f'<td class="n">{v:,.2f}</td>'
        return f"<td>{html.escape('' if v is None else str(v))}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(cell(v) for v in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_inference(lines: list[dict]) -> str:
    """The inference cost lines (hybridflow.ledger.inference.inference_lines) as a table with their total."""
    if not lines:
        return "<p>Nothing served (no serving samples for this day).</p>"
    table = _table(["project", "team", "model", "version", "endpoint", "cluster", "unit", "unit-hours",
                    "USD per unit-hour", "USD"],
                   [[x["project"], x["team"], x["model"], x["version"], x["endpoint"], x["cluster"],
                     "GPU" if x["unit"] == "gpu" else x["unit"], x["unit_hours"], x["usd_per_unit_hour"],
                     x["cost_usd"]] for x in lines])
    total = sum(x["cost_usd"] for x in lines)
    return table.replace("</table>", f'<tr><th colspan="9">inference in all</th><td class="n">{total:,.2f}</td>'
                                     "</tr></table>")


def render_report(engine: Engine, day: date, rows: list[dict], idle: list[dict], costs,
                  inference: list[dict] | None = None) -> str:
    """The day's report page: self-contained (inline SVG and CSS, nothing fetched)."""
    inference = inference or []
    allocated = sum(r["cost_usd"] for r in rows)
    idle_usd = sum(r["cost_usd"] for r in idle)
    effective = sum(r["effective_gpu_hours"] or 0.0 for r in rows)
    hours = sum(r["gpu_hours"] for r in rows)
    waste = sorted((c for c in costs if c.waste), key=lambda c: -c.cost_usd)[:TOP_WASTE]
    kpis = [("Allocated", f"${allocated:,.2f}"), ("Idle owned capacity", f"${idle_usd:,.2f}"),
            ("GPU-hours", f"{hours:,.1f}"), ("Used", f"{100 * effective / hours:.0f} %" if hours else "n/a"),
            ("Preempted GPU-hours", f"{sum(r['preempted_gpu_hours'] for r in rows):,.1f}"),
            ("Inference", f"${sum(x['cost_usd'] for x in inference):,.2f}")]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>GPU cost allocation {day}</title>"
             f"<style>{_STYLE}</style></head><body><h1>GPU cost allocation, {day}</h1>",
             "".join(f'<div class="kpi">{k}<b>{v}</b></div>' for k, v in kpis)]
    for title, svg in _charts(engine, day, rows, costs):
        parts.append(f"<h2>{html.escape(title)}</h2>{svg}")
    parts.append("<h2>Top waste (&ge; 4 GPUs at &lt; 10 % mean use)</h2>")
    parts.append(_table(["run", "DAG run", "try", "project", "GPUs", "mean use %", "GPU-hours", "USD"],
                        [[c.run_key, f"{c.dag_id} / {c.run_id}", c.try_number, c.project, c.gpus,
                          c.mean_util_pct, c.gpu_hours, c.cost_usd] for c in waste]) if waste else "<p>None.</p>")
    parts.append("<h2>Allocation</h2>")
    parts.append(_table(["project", "team", "cluster", "GPU model", "pricing", "GPU-hours", "effective", "USD",
                         "preempted GPU-h", "waste"],
                        [[r["project"], r["team"], r["cluster"], r["gpu_model"], r["pricing_class"], r["gpu_hours"],
                          r["effective_gpu_hours"], r["cost_usd"], r["preempted_gpu_hours"],
                          "yes" if r["waste"] else ""] for r in sorted(rows, key=lambda r: -r["cost_usd"])]))
    parts.append("<h2>Inference cost per project and model version</h2>" + render_inference(inference))
    parts.append("<h2>Idle owned capacity</h2>")
    parts.append(_table(["team", "cluster", "GPU-hours", "USD"],
                        [[r["team"], r["cluster"], r["gpu_hours"], r["cost_usd"]] for r in idle]))
    parts.append("<p>Files: allocation.csv/.parquet, idle.csv/.parquet, attempts.csv/.parquet, "
                 "inference.csv/.parquet in this folder.</p>"
                 "</body></html>")
    return "".join(parts)
