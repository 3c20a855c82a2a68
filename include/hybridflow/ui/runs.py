"""The training runs in the Airflow UI: a list of run records, and one page per DAG run with its
placement decision (every candidate and why it won or lost), staging, training attempts,
checkpoints and artefacts.

Served by the api-server as a plugin FastAPI app (``plugins/hybridflow_ui.py``) under
``/hybridflow``; the run page is linked from every DAG run of ``hybrid_training`` as the
*Placement & record* tab. Access follows Airflow's own: the caller needs read access to the DAG's
runs, checked by the api-server's auth manager with the caller's UI session.

Everything shown is read from the run's folder in private storage, which each step writes as it
finishes, so the page is useful while the run is still going.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

from hybridflow.records import read_records
from hybridflow.runs import RunIdentity, run_dir

PLACEMENT_FILE = "placement.json"
ATTEMPTS_FILE = "train-attempts.json"
EVALUATION_FILE = "evaluation.json"
STAGING_FILE = "staging.json"
QUEUE_FILE = "queue.json"  # hybridflow.queueing: where the run's gang stands while it waits
DEPLOY_FILE = "deploy.json"  # hybridflow.pipeline.deploy: the deploy's outcome, written when it fails too


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def run_view(private_root: Path, dag_id: str, run_id: str) -> dict[str, Any]:
    """What is known about one DAG run, from its folder and its record (``None`` where absent)."""
    run_key = RunIdentity(dag_id, run_id).run_key
    folder = run_dir(private_root, run_key)
    record = next(
        (r for r in sorted(private_root.glob(f"records/*/{run_key}.json")) if r.is_file()), None
    )
    return {
        "dag_id": dag_id,
        "run_id": run_id,
        "run_key": run_key,
        "folder": str(folder),
        "exists": folder.is_dir() or record is not None,
        "placement": _read_json(folder / PLACEMENT_FILE),
        "queue": _read_json(folder / QUEUE_FILE),
        "staging": _read_json(folder / STAGING_FILE),
        "attempts": _read_json(folder / ATTEMPTS_FILE) or [],
        "evaluation": _read_json(folder / EVALUATION_FILE),
        "deploy": _read_json(folder / DEPLOY_FILE),
        "record": _read_json(record) if record else None,
    }


# -- HTML ----------------------------------------------------------------------------------------
_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.2rem; color: #1b1f24; }
h1 { font-size: 1.3rem; margin: 0 0 .8rem; } h2 { font-size: 1.05rem; margin: 1.4rem 0 .4rem; }
table { border-collapse: collapse; margin: .3rem 0; } td, th { padding: .25rem .6rem; text-align: left;
vertical-align: top; border-bottom: 1px solid #d8dee4; } th { background: #f3f5f7; font-weight: 600; }
.won { background: #e8f6ec; } .lost { color: #57606a; } .muted { color: #57606a; } .failed { color: #b3261e; }
h3 { font-size: .95rem; margin: 1rem 0 .3rem; }
ul { margin: .2rem 0 .2rem 1.1rem; padding: 0; } code { font-size: 12px; }
"""


def _page(title: str, body: str) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body>{body}</body></html>"
    )


def _cell(value: Any) -> str:
    if value is None:
        return "<span class='muted'>–</span>"
    if isinstance(value, float):
        return escape(f"{value:.4g}")
    return escape(str(value))


def _kv_table(rows: list[tuple[str, Any]]) -> str:
    return "<table>" + "".join(f"<tr><th>{escape(k)}</th><td>{_cell(v)}</td></tr>" for k, v in rows) + "</table>"


def _reasons(reasons: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{escape(r)}</li>" for r in reasons) + "</ul>" if reasons else ""


def render_placement(placement: dict | None) -> str:
    if not placement:
        return "<p class='muted'>choose_cluster has not finished for this run yet.</p>"
    head = (
        f"<p><b>{escape(placement['cluster'])}</b> / {escape(placement['node_pool'])} "
        f"({escape(placement['location'])}, {escape(placement['pricing_class'])} at "
        f"{placement['price_per_gpu_hour']:.2f} USD/GPU-hour) for {placement['gpus']} x "
        f"{escape(placement['gpu_model'])}</p>{_reasons(placement.get('reasons', []))}"
    )
    failovers = placement.get("failovers") or []
    if failovers:
        head += "<p>Failed over from:</p>" + _reasons([f"{f['cluster']}: {f['reason']}" for f in failovers])
    rows = []
    for c in placement.get("candidates", []):
        css = "won" if c.get("cluster") == placement["cluster"] else "lost"
        verdict = "chosen" if css == "won" else ("eligible" if c.get("eligible") else "ineligible")
        rows.append(
            f"<tr class='{css}'><td>{_cell(c.get('cluster'))}</td><td>{_cell(c.get('location'))}</td>"
            f"<td>{verdict}</td><td>{_cell(c.get('node_pool'))}</td><td>{_cell(c.get('pricing_class'))}</td>"
            f"<td>{_cell(c.get('price_per_gpu_hour'))}</td><td>{_cell(c.get('load'))}</td>"
            f"<td>{_reasons(c.get('reasons', []))}</td></tr>"
        )
    table = (
        "<table><tr><th>cluster</th><th>location</th><th>verdict</th><th>node pool</th><th>pricing</th>"
        "<th>USD/GPU-h</th><th>load</th><th>why</th></tr>" + "".join(rows) + "</table>"
    )
    return head + table


def render_queue(queue: dict | None) -> str:
    """The gang's wait for admission: where it stands now, or how the wait ended."""
    if not queue:
        return ""
    if queue.get("over_team_cap"):
        where = "held by its team's gpu_cap"
    elif queue.get("position"):
        where = f"position {queue['position']}, {queue.get('gpus_ahead', 0)} GPUs ahead"
    else:
        where = None
    rows = [("state", queue.get("state")), ("cluster", queue.get("cluster")), ("queued since", queue.get("queued_since")),
            ("waited (s)", queue.get("waited_s")), ("in the queue", where),
            ("free GPUs", f"{queue['free']} of {queue['capacity']}" if "free" in queue else None),
            ("estimated start", queue.get("estimated_start")), ("estimate from", queue.get("estimate_basis")),
            ("as of", queue.get("updated_at"))]
    return "<h2>Queue</h2>" + _kv_table(rows)


def render_staging(staging: dict | None) -> str:
    if not staging:
        return "<p class='muted'>Nothing staged (private cluster, or stage_data has not run).</p>"
    return _kv_table(
        [
            ("store", staging.get("store_uri")),
            ("dataset version", staging.get("version")),
            ("objects copied / total", f"{staging.get('objects_copied')} / {staging.get('objects_total')}"),
            ("bytes copied", staging.get("bytes_copied")),
            ("seconds", staging.get("seconds")),
        ]
    )


def render_attempts(attempts: list[dict]) -> str:
    if not attempts:
        return "<p class='muted'>The train task has not started.</p>"
    rows = "".join(
        f"<tr><td>{_cell(a.get('attempt') or a.get('try_number'))}</td><td>{_cell(a.get('cluster'))}</td>"
        f"<td>{_cell(a.get('workers'))}</td><td>{_cell(a.get('started_at'))}</td>"
        f"<td>{_cell(a.get('seconds'))}</td><td>{_cell(a.get('outcome'))}</td>"
        f"<td>{_cell(a.get('start_step'))}</td><td>{_cell(a.get('last_step'))}</td>"
        f"<td>{_cell(a.get('last_committed_step'))}</td></tr>"
        for a in attempts
    )
    return (
        "<table><tr><th>attempt</th><th>cluster</th><th>GPUs</th><th>started</th><th>seconds</th>"
        "<th>outcome</th><th>from step</th><th>last step</th><th>last checkpoint</th></tr>"
        f"{rows}</table>"
    )


def render_record(rec: dict, evaluation: dict | None) -> str:
    """The run record's table; before the record step, the held-out metric so far."""
    if not rec:
        evaluation = evaluation or {}
        return (
            "<p class='muted'>The record step has not run yet"
            + (f"; held-out {_metric(evaluation['metric'])} so far" if evaluation.get("metric") else "")
            + ".</p>"
        )
    ckpt = rec.get("checkpoints") or {}
    return _kv_table(
        [
            ("project / team", f"{rec.get('project')} / {rec.get('team')}"),
            ("model", rec.get("model")),
            ("dataset", f"{rec.get('dataset')} ({rec.get('classification')}"
                        + (f", regions {', '.join(rec['regions'])}" if rec.get("regions") else "")
                        + f"), version {rec.get('dataset_version')}"),
            ("triggered by", rec.get("triggered_by")),
            ("GPUs x type", f"{rec.get('workers')} x {rec.get('gpu_type')}"),
            ("GPU-hours", rec.get("gpu_hours")),
            ("checkpoints", f"{ckpt.get('count')} written, resumed from step {ckpt.get('resumed_from_step')}, "
                            f"final step {ckpt.get('final_step')}"),
            *(
                [("training", f"{training.get('steps_trained')} steps trained, {training.get('preemptions')} "
                              f"preemptions, {training.get('steps_lost')} steps redone")]
                if (training := rec.get("training"))
                else []
            ),
            ("held-out metric", _metric(rec.get("metric"))),
            ("compressed as", (rec.get("compression") or {}).get("selected")),
            ("endpoint", rec.get("endpoint")),
            ("model version", rec.get("model_version")),
            *((f"artefact: {k}", v) for k, v in (rec.get("artefacts") or {}).items()),
        ]
    )


def render_run(view: dict[str, Any]) -> str:
    title = f"{view['dag_id']} / {view['run_id']}"
    parts = [f"<h1>{escape(title)}</h1>"]
    if not view["exists"]:
        parts.append(
            "<p class='muted'>Nothing is recorded for this run: admit refused it or it has not started. "
            "The admit task's log says why.</p>"
        )
        return _page(title, "".join(parts))
    rec = view["record"] or {}
    parts.append("<h2>Placement</h2>" + render_placement(view["placement"]))
    parts.append(render_queue(view.get("queue")))
    parts.append("<h2>Staging</h2>" + render_staging(view["staging"] or rec.get("staging")))
    parts.append("<h2>Training attempts</h2>" + render_attempts(view["attempts"]))
    parts.append("<h2>Record</h2>" + render_record(rec, view["evaluation"]))
    parts.append(render_deploy(rec.get("deploy") or view.get("deploy")))
    parts.append(f"<p class='muted'>Run folder: <code>{escape(view['folder'])}</code></p>")
    return _page(title, "".join(parts))


# -- the deploy: gate, canary steps, rollback -------------------------------------------------------
_FIGURE_ROWS = (("requests", "requests", "{:.0f}"), ("requests/s", "rps", "{:.1f}"), ("p50 ms", "p50_ms", "{:.2f}"),
                ("p99 ms", "p99_ms", "{:.2f}"), ("error rate", "error_rate", "{:.2%}"))


def _fig(figs: dict | None, key: str, fmt: str) -> str:
    value = (figs or {}).get(key)
    if value is None:
        return _cell(None)
    try:
        return escape(fmt.format(value))
    except (TypeError, ValueError):
        return _cell(value)


def _verdict(passed: bool | None) -> str:
    return _cell(None) if passed is None else ("<b>passed</b>" if passed else "<b class='failed'>failed</b>")


def _gate_bars(bars: dict) -> dict[str, str]:
    p99 = f"≤ {bars['p99_ms']:g}" if bars.get("p99_ms") is not None else ""
    if bars.get("max_p99_regression") is not None:
        p99 += f"; ≤ serving × {1 + bars['max_p99_regression']:g}"
    return {
        "rps": f"≥ {bars['min_rps']:g}" if bars.get("min_rps") is not None else "",
        "p99_ms": p99,
        "error_rate": f"≤ {bars['max_error_rate']:.2%}" if bars.get("max_error_rate") is not None else "",
    }


def render_gate(gate: dict, version: Any, previous: Any) -> str:
    """The load test of the new version beside the serving one's, the bars, and the verdict."""
    bars = gate.get("bars") or {}
    load = (f" ({bars['concurrency']} users for {bars['duration_s']:g} s each)"
            if bars.get("concurrency") and bars.get("duration_s") else "")
    shown = _gate_bars(bars)
    rows = "".join(
        f"<tr><th>{label}</th><td>{_fig(gate.get('new'), key, fmt)}</td><td>{_fig(gate.get('serving'), key, fmt)}</td>"
        f"<td>{escape(shown.get(key, ''))}</td></tr>"
        for label, key, fmt in _FIGURE_ROWS
    )
    return (
        f"<h3>Gate: {_verdict(gate.get('passed'))}{escape(load)}</h3>"
        f"<table><tr><th></th><th>new {_cell(version)}</th><th>serving {_cell(previous)}</th><th>bar</th></tr>"
        f"{rows}</table>{_reasons(gate.get('reasons') or [])}"
    )


def render_canary(steps: list[dict]) -> str:
    """Each traffic step: the canary's and the stable version's figures over its window, and the verdict."""
    head = "".join(f"<th>{label}</th>" for label, _, _ in _FIGURE_ROWS)
    rows = []
    for step in steps:
        for i, side in enumerate(("canary", "stable")):
            cells = "".join(f"<td>{_fig(step.get(side), key, fmt)}</td>" for _, key, fmt in _FIGURE_ROWS)
            lead = (f"<td rowspan='2'>{_cell(step.get('percent'))} %</td>" if i == 0 else "")
            tail = (f"<td rowspan='2'>{_verdict(step.get('passed'))}{_reasons(step.get('reasons') or [])}</td>"
                    if i == 0 else "")
            rows.append(f"<tr>{lead}<td>{side}</td>{cells}{tail}</tr>")
    return (f"<h3>Canary steps</h3><table><tr><th>traffic</th><th></th>{head}<th>verdict</th></tr>"
            + "".join(rows) + "</table>")


def render_deploy(outcome: dict | None) -> str:
    """The deploy: its versions and status, the gate, the canary steps and a rollback's reason."""
    if not outcome:
        return ""
    status = outcome.get("status")
    rows = [("endpoint", outcome.get("endpoint")), ("version", outcome.get("version")),
            ("previous version", outcome.get("previous_version")), ("status", status),
            ("target", outcome.get("target")), ("variant", outcome.get("variant"))]
    if smoke := outcome.get("smoke_metric"):
        value = smoke.get("value")
        shown = f"{value:.4f}" if isinstance(value, int | float) else value
        rows.append(("smoke test (held-out)", f"{smoke.get('name')} {shown} (gate {smoke.get('gate')})"))
    parts = ["<h2>Deploy</h2>"]
    if back := outcome.get("rolled_back"):
        step = back.get("step")
        where = f"the {step} % traffic step" if isinstance(step, int | float) else f"the {step} step"
        parts.append(f"<p class='failed'><b>Rolled back</b> at {escape(where)}: {escape(str(back.get('reason')))}; "
                     f"{escape(str(back.get('serving') or 'the previous version'))} serves.</p>")
    elif status == "kept":
        parts.append("<p class='muted'>This version was already serving: nothing changed.</p>")
    parts.append(_kv_table(rows))
    if gate := outcome.get("gate"):
        parts.append(render_gate(gate, outcome.get("version"), outcome.get("previous_version")))
    if steps := outcome.get("canary"):
        parts.append(render_canary(steps))
    return "".join(parts)


def _metric(metric: dict | None) -> str:
    """``roc_auc 0.9876 (gate 0.95)`` from a record's metric."""
    if not metric:
        return "-"
    return f"{metric.get('name')} {metric.get('value', float('nan')):.4f} (gate {metric.get('gate')})"


def render_run_list(records: list[dict]) -> str:
    records = sorted(records, key=lambda r: r.get("recorded_at") or "", reverse=True)
    rows = "".join(
        f"<tr><td><a href='runs/{escape(r['dag_id'])}/{escape(r['run_id'])}'>{escape(r['run_id'])}</a></td>"
        f"<td>{_cell(r.get('project'))}</td><td>{_cell(r.get('team'))}</td><td>{_cell(r.get('cluster'))}</td>"
        f"<td>{_cell(r.get('pricing_class'))}</td><td>{_cell(r.get('workers'))}</td>"
        f"<td>{_cell(r.get('model'))}</td>"
        f"<td>{_cell(r.get('gpu_hours'))}</td><td>{escape(_metric(r.get('metric')))}</td>"
        f"<td>{_cell(r.get('recorded_at'))}</td></tr>"
        for r in records
    )
    body = (
        "<h1>Training runs</h1>"
        + (
            "<table><tr><th>run</th><th>project</th><th>team</th><th>cluster</th><th>pricing</th>"
            f"<th>GPUs</th><th>model</th><th>GPU-hours</th><th>held-out metric</th><th>recorded</th></tr>{rows}</table>"
            if records
            else "<p class='muted'>No run has been recorded yet.</p>"
        )
    )
    return _page("Training runs", body)


# -- FastAPI -------------------------------------------------------------------------------------
def create_app(private_root: Path | None = None, *, authorize: bool = True):
    """The plugin app. ``authorize=False`` only for tests that call it without an api-server."""
    from fastapi import Depends, FastAPI
    from fastapi.responses import HTMLResponse

    from hybridflow.settings import get_settings

    def root() -> Path:
        return private_root or get_settings().private_root

    dag_access: list = []
    list_access: list = []
    if authorize:
        from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
        from airflow.api_fastapi.core_api.security import requires_access_dag

        dag_access = [Depends(requires_access_dag("GET", DagAccessEntity.RUN))]
        list_access = [Depends(requires_access_dag("GET", DagAccessEntity.RUN, param_dag_id="hybrid_training"))]

    app = FastAPI(title="hybridflow runs", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/runs", response_class=HTMLResponse, dependencies=list_access)
    def runs_page() -> str:
        return render_run_list(read_records(root()))

    @app.get("/runs/{dag_id}/{run_id:path}", response_class=HTMLResponse, dependencies=dag_access)
    def run_page(dag_id: str, run_id: str) -> str:
        return render_run(run_view(root(), dag_id, run_id))

    @app.get("/api/runs/{dag_id}/{run_id:path}", dependencies=dag_access)
    def run_json(dag_id: str, run_id: str) -> dict:
        return run_view(root(), dag_id, run_id)

    return app
