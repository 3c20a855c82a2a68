"""Clusters & DR in the Airflow UI: every cluster of the estate, up or declared down (since when, by
whom, why, and what draining it did), the endpoints served on the disaster-recovery side now, the
recent declarations, and a form per cluster to declare it down or up.

Mounted on the plugin app of :mod:`hybridflow.ui.runs` under ``/hybridflow/clusters``; reading needs
read access to the ``cluster_fence`` DAG's runs.

Declaring is never done by this app. The form's script triggers a run of the ``cluster_fence`` DAG
through Airflow's public REST API (``POST /api/v2/dags/cluster_fence/dagRuns``, conf ``{action,
cluster, reason}``) and links to the run it created. Why the public API rather than a POST route of
this app that creates the run itself:

* it is Airflow's versioned, documented contract, while creating a run server-side means calling
  the api-server's internal trigger code (serialized DAG lookup, sessions), which moves between
  minor releases;
* Airflow itself then checks the caller may trigger ``cluster_fence``, validates the conf against the
  DAG's Params, records ``triggering_user_name`` (kept as who declared) and audits the run, exactly as
  for the trigger form;
* no credential is handled here: the api-server authenticates a request without an Authorization
  header by the UI session's ``_token`` cookie (``SameSite=Lax``, so another site's page cannot
  post with it), which a same-origin ``fetch`` sends; the pages of this app are authorised by the
  same cookie.

The API is addressed relative to this page (``../api/v2/...``), so a ``base_url`` prefix in front of
the api-server works unchanged. The work itself (fence, drain, failback) runs on a worker, whose task
refuses bad input naming the Param; the script only refuses a blank reason before posting. The link
to the created run moves the UI itself: the UI frames plugin pages in a sandbox without
``allow-top-navigation`` (a ``target=_top`` link is blocked there), so the script pushes the run's
address onto the UI's history, which the UI's router follows as it does the browser's back button.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from html import escape
from typing import Any

from hybridflow.dr.fencing.task import REASON_MAX_CHARS
from hybridflow.ui.runs import _cell, _page

FENCE_DAG = "cluster_fence"
HISTORY_SHOWN = 20  # the page shows the newest declarations; the fence file keeps them all

_STYLE = """
.down { background: #ffebe9; } .takeover { background: #fff8c5; padding: .4rem .6rem; }
form.declare { display: flex; gap: .4rem; align-items: center; margin: 0; }
form.declare input[name=reason] { width: 16rem; } .outcome { font-size: 12px; }
"""

# Posts the form as a cluster_fence run; output goes in through textContent only (API text is not HTML).
_SCRIPT = """
const DAG_RUNS = "../api/v2/dags/cluster_fence/dagRuns";
const RUN_PAGE = "../dags/cluster_fence/runs/";
function problem(status, body) {
  const detail = body && body.detail;
  const text = Array.isArray(detail) ? detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("; ")
    : (typeof detail === "string" ? detail : JSON.stringify(body));
  return `refused (HTTP ${status}): ${text}`;
}
// The Airflow UI frames this page in a sandbox without allow-top-navigation, where a target=_top
// link is blocked; the UI is of this origin, so its own history moves it to the run instead.
function showInUI(click, href) {
  let ui = null;
  try {
    ui = window.top !== window && window.top.location.origin === window.location.origin ? window.top : null;
  } catch (err) {
    ui = null;
  }
  if (ui === null) return;  // not framed by the UI: the link itself navigates
  click.preventDefault();
  ui.history.pushState(null, "", href);
  ui.dispatchEvent(new ui.PopStateEvent("popstate", {state: null}));
}
for (const form of document.querySelectorAll("form.declare")) {
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const out = form.querySelector(".outcome");
    const button = form.querySelector("button");
    const field = form.querySelector("input[name=reason]");
    const reason = field ? field.value.trim() : null;
    if (field && !reason) {
      out.textContent = "reason: say why the cluster is declared down, e.g. power loss in dc-1";
      return;
    }
    const conf = {action: form.dataset.action, cluster: form.dataset.cluster, reason: reason};
    button.disabled = true;
    out.textContent = "triggering cluster_fence…";
    try {
      const response = await fetch(new URL(DAG_RUNS, document.baseURI), {
        method: "POST", credentials: "same-origin",
        headers: {"Content-Type": "application/json", "Accept": "application/json"},
        body: JSON.stringify({logical_date: null, conf: conf}),
      });
      const body = await response.json().catch(() => null);
      if (!response.ok) {
        out.textContent = problem(response.status, body);
        button.disabled = false;
        return;
      }
      const link = document.createElement("a");
      link.href = new URL(RUN_PAGE + encodeURIComponent(body.dag_run_id), document.baseURI).href;
      link.target = "_top";
      link.textContent = body.dag_run_id;
      link.addEventListener("click", (click) => showInUI(click, link.href));
      out.replaceChildren("triggered run ", link, "; reload this page when it has finished");
    } catch (err) {
      out.textContent = `the Airflow API did not answer: ${err}`;
      button.disabled = false;
    }
  });
}
"""


# -- the view ------------------------------------------------------------------------------------
def gangs_summary(gangs: Mapping[str, Any] | None) -> str:
    """One line on what draining did to the cluster's running gangs."""
    if not gangs:
        return "not drained"
    stopped = list(gangs.get("stopped") or [])
    named = f"{len(stopped)} gang(s) checkpointed and stopped" + (f" ({', '.join(stopped)})" if stopped else "")
    if not gangs.get("answered", True):
        return f"the cluster did not answer, so its gangs could not be checkpointed: {gangs.get('error')}" + (
            f"; {named} before that" if stopped else "")
    gone = list(gangs.get("gone") or [])
    return (named if stopped else "no running gang") + (f"; {len(gone)} had ended already" if gone else "")


def serving_summary(serving: Any) -> list[str]:
    """What happened to serving, one line per endpoint where endpoints were moved (or not), and why."""
    if serving is None:
        return []
    if isinstance(serving, str):
        return [serving]
    lines = [str(serving["note"])] if serving.get("note") else []
    for endpoint, outcome in sorted((serving.get("endpoints") or {}).items()):
        state = outcome.get("state", "?")
        why = outcome.get("reason") or outcome.get("note")
        lines.append(f"{endpoint}: {state}" + (f" ({why})" if why else ""))
    if not lines:
        lines.append("serving moved to the DR side" if serving.get("drained") else "serving not moved")
    return lines


def served_on_dr(state_dir: Any) -> list[dict[str, Any]]:
    """The endpoints served on the DR side now: the model gateway's takeovers and the DR pool's."""
    from hybridflow.dr.failover.serving import TAKEOVER, takeovers
    from hybridflow.dr.failover.serving_k8s import pool_takeovers

    rows = [{"endpoint": e, "path": "model gateway", **_served(a[TAKEOVER])} for e, a in takeovers(state_dir).items()]
    rows += [{"endpoint": e, "path": "inference pool", **_served(r)} for e, r in pool_takeovers(state_dir).items()]
    return sorted(rows, key=lambda r: (r["endpoint"], r["path"]))


def _served(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {k: entry.get(k) for k in ("cluster", "version", "url", "since", "source")}


def cluster_view(estate: Any, state_dir: Any) -> dict[str, Any]:
    """Everything the page shows, also its JSON: clusters with their state and the action offered,
    the DR endpoints, and the newest declarations first."""
    from hybridflow.fencing import down_clusters, fence_status, state_path

    status = fence_status(estate, state_path(state_dir))
    has_dr = bool(status["dr_clusters"])
    clusters = []
    for name, cluster in sorted(estate.clusters.items()):
        record = status["clusters"][name].get("down")
        clusters.append(_cluster_row(name, cluster.role, cluster.location, cluster.backend, record, has_dr))
    for name, record in sorted(down_clusters(state_path(state_dir)).items()):
        if name not in estate.clusters:  # removed from clusters.yaml while down: it can still be declared up
            clusters.append(_cluster_row(name, "not in clusters.yaml", None, None, record, has_dr))
    history = list(reversed(status["history"]))[:HISTORY_SHOWN]
    return {"takeover": status["takeover"], "primaries_down": status["primaries_down"],
            "dr_clusters": status["dr_clusters"], "clusters": clusters, "served_on_dr": served_on_dr(state_dir),
            "history": [{**h, "summary": serving_summary(h.get("serving"))} for h in history], "note": ""}


def _cluster_row(name: str, role: str, location: Any, backend: Any, record: Mapping[str, Any] | None,
                 has_dr: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"cluster": name, "role": role, "location": location, "backend": backend,
                           "state": "down" if record else "up"}
    if record:
        drain = record.get("drain") or {}
        row.update(since=record.get("declared_at"), by=record.get("by"), reason=record.get("reason"),
                   drained_at=drain.get("at"), gangs=gangs_summary(drain.get("gangs")),
                   serving=serving_summary(drain.get("serving")), action="up")
    else:
        row["action"] = "down" if role != "dr" and has_dr else None
    return row


# -- HTML ----------------------------------------------------------------------------------------
def _lines(lines: list[str]) -> str:
    return "<br>".join(escape(line) for line in lines) if lines else _cell(None)


def _form(row: Mapping[str, Any]) -> str:
    action = row.get("action")
    if action is None:
        return _cell(None)
    target = f"data-action='{escape(action)}' data-cluster='{escape(row['cluster'])}'"
    reason = (f"<input name='reason' required maxlength='{REASON_MAX_CHARS}' aria-label='reason' "
              "placeholder='why, e.g. power loss in dc-1'>") if action == "down" else ""
    label = "Declare down" if action == "down" else "Declare up"
    return (f"<form class='declare' {target}>{reason}<button type='submit'>{label}</button>"
            "<span class='outcome' role='status'></span></form>")


def _state(row: Mapping[str, Any]) -> str:
    if row["state"] != "down":
        return "up"
    return (f"<b>down</b> since {_cell(row.get('since'))} by {_cell(row.get('by'))}"
            f"<br><span class='muted'>why:</span> {_cell(row.get('reason'))}")


def _drain(row: Mapping[str, Any]) -> str:
    if row["state"] != "down":
        return _cell(None)
    return (f"{escape(row['gangs'])}<br><span class='muted'>serving:</span> {_lines(row['serving'])}"
            + (f"<br><span class='muted'>drained at {escape(row['drained_at'])}</span>" if row.get("drained_at")
               else ""))


def _clusters_table(rows: list[dict[str, Any]]) -> str:
    body = "".join(
        f"<tr class='{'down' if r['state'] == 'down' else 'up'}'><td>{escape(r['cluster'])}</td>"
        f"<td>{_cell(r['role'])}</td><td>{_cell(r['location'])}</td><td>{_cell(r['backend'])}</td>"
        f"<td>{_state(r)}</td><td>{_drain(r)}</td><td>{_form(r)}</td></tr>" for r in rows)
    return ("<table><tr><th>cluster</th><th>role</th><th>location</th><th>backend</th><th>state</th>"
            f"<th>drain</th><th>declare</th></tr>{body}</table>")


def _served_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p class='muted'>No endpoint is served on the DR side.</p>"
    body = "".join(f"<tr><td>{escape(r['endpoint'])}</td><td>{escape(r['path'])}</td><td>{_cell(r['cluster'])}</td>"
                   f"<td>{_cell(r['version'])}</td><td>{_cell(r['url'])}</td><td>{_cell(r['since'])}</td></tr>"
                   for r in rows)
    return ("<table><tr><th>endpoint</th><th>served by</th><th>DR cluster</th><th>version</th><th>url</th>"
            f"<th>since</th></tr>{body}</table>")


def _history_table(events: list[dict[str, Any]]) -> str:
    if not events:
        return "<p class='muted'>No cluster was ever declared down.</p>"
    body = "".join(
        f"<tr><td>{_cell(h.get('at'))}</td><td>{_cell(h.get('event'))}</td><td>{_cell(h.get('cluster'))}</td>"
        f"<td>{_cell(h.get('by'))}</td><td>{_cell(h.get('reason') or h.get('down_reason'))}</td>"
        f"<td>{_lines(h.get('summary') or [])}</td></tr>" for h in events)
    return ("<table><tr><th>at</th><th>event</th><th>cluster</th><th>by</th><th>reason</th><th>serving</th></tr>"
            f"{body}</table>")


def render_clusters(view: Mapping[str, Any]) -> str:
    parts = [f"<style>{_STYLE}</style><h1>Clusters &amp; DR</h1>"]
    if view.get("note"):
        parts.append(f"<p class='failed'>{escape(view['note'])}</p>")
    if view.get("takeover"):
        parts.append(f"<p class='takeover'>Takeover: primary {escape(', '.join(view['primaries_down']))} declared "
                     "down; critical runs may use the disaster-recovery pool, normal runs wait, batch runs are "
                     "paused.</p>")
    if not view.get("dr_clusters"):
        parts.append("<p class='muted'>No cluster has role: dr, so none can be declared down: nothing would take "
                     "over (add a disaster-recovery pool to clusters.yaml).</p>")
    parts.append(f"<p class='muted'>Declaring triggers a run of the {FENCE_DAG} DAG as you: the fence, the "
                 "drain and the failback run on a worker.</p>")
    parts += [_clusters_table(view.get("clusters") or []), "<h2>Served on the DR side now</h2>",
              _served_table(view.get("served_on_dr") or []), "<h2>Recent declarations</h2>",
              _history_table(view.get("history") or []), f"<script>{_SCRIPT}</script>"]
    return _page("Clusters & DR", "".join(parts))


# -- FastAPI -------------------------------------------------------------------------------------
def _read_settings_view() -> dict[str, Any]:
    from hybridflow.config import load_estate
    from hybridflow.errors import HybridFlowError
    from hybridflow.settings import get_settings

    settings = get_settings()
    try:
        return cluster_view(load_estate(settings.config_dir), settings.state_dir)
    except (OSError, ValueError, HybridFlowError) as exc:  # shown, not hidden: the operator must see the state is unreadable
        return {"clusters": [], "served_on_dr": [], "history": [], "dr_clusters": [], "takeover": False,
                "primaries_down": [], "note": f"The cluster state could not be read: {type(exc).__name__}: {exc}"}


def add_cluster_pages(app, *, source: Callable[[], dict[str, Any]] | None = None, authorize: bool = True) -> None:
    """Mount ``/clusters`` and ``/api/clusters`` on the plugin app; ``source`` returns the view
    (default: the settings' clusters.yaml and state). ``authorize=False`` only for tests without an
    api-server."""
    from fastapi.responses import HTMLResponse

    access: list = []
    if authorize:
        from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
        from airflow.api_fastapi.core_api.security import requires_access_dag
        from fastapi import Depends

        access = [Depends(requires_access_dag("GET", DagAccessEntity.RUN, param_dag_id=FENCE_DAG))]
    read = source or _read_settings_view

    @app.get("/clusters", response_class=HTMLResponse, dependencies=access)
    def clusters_page() -> str:
        return render_clusters(read())

    @app.get("/api/clusters", dependencies=access)
    def clusters_json() -> dict:
        return read()
