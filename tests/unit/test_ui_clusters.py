"""The Clusters & DR page: every cluster with its state, a cluster down with who, when, why and what
draining did, the endpoints served on the DR side, the declarations newest first, names escaped,
the JSON, and the request its form's script sends to Airflow's REST API to trigger cluster_fence."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from tests.support.dr_config import config_with_dr

from hybridflow.config import Estate, load_estate
from hybridflow.dr.fencing.failback import declare_up
from hybridflow.fencing import declare_down, record_drain, state_path
from hybridflow.serving.router import ACTIVE_FILE, TAKEOVER
from hybridflow.settings import REPO_ROOT
from hybridflow.ui.clusters import add_cluster_pages, cluster_view

REASON = "power loss in dc-1 <b>&</b> 'UPS'"
DRAIN = {
    "at": "2027-03-01T08:00:05+00:00",
    "gangs": {"answered": True, "stopped": ["gang-a", "gang-b"], "gone": []},
    "serving": {"entry": "the model gateway on 127.0.0.1:8088", "drained": False, "dr_cluster": "dr-west",
                "endpoints": {"fraud": {"state": "on dr"},
                              "churn": {"state": "not moved", "reason": "no replica of churn in the DR store"}}},
}


def _estate(tmp_path: Path, with_dr: bool = True) -> Estate:
    return load_estate(config_with_dr(tmp_path, with_dr), use_cache=False)


def _client(source) -> TestClient:
    app = FastAPI()
    add_cluster_pages(app, source=source, authorize=False)
    return TestClient(app)


class _Forms(HTMLParser):
    """The declare forms of a page: their data attributes and whether they ask for a reason."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: list[dict] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attrs = dict(attrs)
        if tag == "form" and "declare" in (attrs.get("class") or ""):
            self.forms.append({"action": attrs["data-action"], "cluster": attrs["data-cluster"], "reason": None})
        elif tag == "input" and attrs.get("name") == "reason":
            self.forms[-1]["reason"] = {"required": "required" in attrs}


def _forms(html: str) -> dict[str, dict]:
    parser = _Forms()
    parser.feed(html)
    return {f["cluster"]: f for f in parser.forms}


@pytest.fixture
def estate(tmp_path: Path) -> Estate:
    return _estate(tmp_path)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


def test_a_cluster_down_shows_who_when_why_its_drain_and_declare_up(estate: Estate, state_dir: Path) -> None:
    path = state_path(state_dir)
    declare_down("onprem-a", "cooling failure", by="alice", estate=estate, path=path,
                 now=datetime(2027, 2, 1, 9, tzinfo=UTC))
    declare_up("onprem-a", by="bob", estate=estate, path=path, now=datetime(2027, 2, 1, 12, tzinfo=UTC))
    declare_down("onprem-a", REASON, by="carol<ops>", estate=estate, path=path,
                 now=datetime(2027, 3, 1, 8, tzinfo=UTC))
    record_drain("onprem-a", DRAIN, path=path)
    client = _client(lambda: cluster_view(estate, state_dir))
    html = client.get("/clusters").text

    assert "<h1>Clusters &amp; DR</h1>" in html and "Takeover: primary onprem-a declared down" in html
    row = html[html.index("<td>onprem-a</td>"):].split("</tr>")[0]
    assert "<td>primary</td><td>private</td><td>local</td>" in row
    assert ("<b>down</b> since 2027-03-01T08:00:00+00:00 by carol&lt;ops&gt;<br><span class='muted'>why:</span> "
            "power loss in dc-1 &lt;b&gt;&amp;&lt;/b&gt; &#x27;UPS&#x27;") in row
    assert "2 gang(s) checkpointed and stopped (gang-a, gang-b)" in row
    assert "churn: not moved (no replica of churn in the DR store)<br>fraud: on dr" in row
    assert "<b>&</b>" not in html and "carol<ops>" not in html

    forms = _forms(html)
    assert forms["onprem-a"] == {"action": "up", "cluster": "onprem-a", "reason": None}
    assert "Declare up" in row and "Declare down" not in row
    assert forms["cloud-east"] == {"action": "down", "cluster": "cloud-east", "reason": {"required": True}}
    assert "dr-west" not in forms  # the DR cluster is never declared down or up from here
    dr_row = html[html.index("<td>dr-west</td>"):].split("</tr>")[0]
    assert "<td>dr</td>" in dr_row and "<form" not in dr_row

    history = html[html.index("<h2>Recent declarations</h2>"):]
    assert history.index("carol&lt;ops&gt;") < history.index("<td>bob</td>") < history.index("<td>alice</td>")
    assert "<td>up</td><td>onprem-a</td><td>bob</td><td>cooling failure</td>" in history

    body = client.get("/api/clusters").json()
    by_name = {c["cluster"]: c for c in body["clusters"]}
    assert body["takeover"] is True and body["primaries_down"] == ["onprem-a"] and body["dr_clusters"] == ["dr-west"]
    assert by_name["onprem-a"] == {
        "cluster": "onprem-a", "role": "primary", "location": "private", "backend": "local", "state": "down",
        "since": "2027-03-01T08:00:00+00:00", "by": "carol<ops>", "reason": REASON, "action": "up",
        "drained_at": DRAIN["at"], "gangs": "2 gang(s) checkpointed and stopped (gang-a, gang-b)",
        "serving": ["churn: not moved (no replica of churn in the DR store)", "fraud: on dr"]}
    assert by_name["cloud-east"]["state"] == "up" and by_name["cloud-east"]["action"] == "down"
    assert by_name["dr-west"]["action"] is None
    assert [(h["event"], h["by"]) for h in body["history"]] == [("down", "carol<ops>"), ("up", "bob"), ("down", "alice")]


def test_a_cluster_that_did_not_answer_and_the_endpoints_served_on_dr(estate: Estate, state_dir: Path) -> None:
    path = state_path(state_dir)
    declare_down("onprem-a", "fire", by="alice", estate=estate, path=path)
    record_drain("onprem-a", {"gangs": {"answered": False, "error": "ConnectionError: refused", "stopped": []},
                              "serving": {"entry": None, "drained": False,
                                          "note": "no serving entry on onprem-a: the inference pool is on k8s-a"}},
                 path=path)
    gateway = state_dir / "serving" / "fraud"
    gateway.mkdir(parents=True)
    (gateway / ACTIVE_FILE).write_text(json.dumps({"version": "v3", "url": "http://127.0.0.1:9101", TAKEOVER: {
        "cluster": "dr-west", "version": "v3", "url": "http://127.0.0.1:9207", "since": "2027-03-01T08:00:09+00:00"}}))
    pool = state_dir / "serving" / "churn"
    pool.mkdir(parents=True)
    (pool / "takeover-k8s.json").write_text(json.dumps({
        "endpoint": "churn", "cluster": "dr-west", "version": "v7", "url": "http://churn.dr.example",
        "since": "2027-03-01T08:00:30+00:00", "primary": {"cluster": "k8s-a", "version": "v7"}}))
    client = _client(lambda: cluster_view(estate, state_dir))
    html = client.get("/clusters").text

    assert ("the cluster did not answer, so its gangs could not be checkpointed: ConnectionError: refused" in html)
    assert "no serving entry on onprem-a: the inference pool is on k8s-a" in html
    served = html[html.index("<h2>Served on the DR side now</h2>"):html.index("<h2>Recent declarations</h2>")]
    assert ("<td>churn</td><td>inference pool</td><td>dr-west</td><td>v7</td><td>http://churn.dr.example</td>"
            "<td>2027-03-01T08:00:30+00:00</td>") in served
    assert "<td>fraud</td><td>model gateway</td><td>dr-west</td><td>v3</td><td>http://127.0.0.1:9207</td>" in served
    assert [(s["endpoint"], s["path"]) for s in client.get("/api/clusters").json()["served_on_dr"]] == [
        ("churn", "inference pool"), ("fraud", "model gateway")]


def test_without_a_dr_cluster_nothing_can_be_declared_down_and_the_page_says_why(tmp_path: Path) -> None:
    estate = _estate(tmp_path, with_dr=False)
    html = _client(lambda: cluster_view(estate, tmp_path / "state")).get("/clusters").text
    assert "No cluster has role: dr, so none can be declared down" in html
    assert _forms(html) == {}
    assert "No cluster was ever declared down." in html and "No endpoint is served on the DR side." in html


def test_names_from_the_view_are_escaped_in_text_and_in_form_attributes() -> None:
    hostile = "x' onmouseover='alert(1)<script>"
    view = {"takeover": False, "primaries_down": [], "dr_clusters": ["dr-west"], "served_on_dr": [], "history": [],
            "note": "", "clusters": [{"cluster": hostile, "role": "elastic", "location": "public",
                                      "backend": "kubernetes", "state": "up", "action": "down"}]}
    html = _client(lambda: view).get("/clusters").text
    assert "<script>" not in html.split("<script>\n")[0]  # the page's own script is the only one
    assert "onmouseover='alert" not in html and "x&#x27; onmouseover=&#x27;alert(1)&lt;script&gt;" in html
    assert _forms(html)[hostile]["action"] == "down"  # the attribute round-trips to the exact name
    assert _client(lambda: view).get("/api/clusters").json() == view


def test_an_unreadable_fence_file_is_said_not_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(REPO_ROOT / "config"))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path))
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "fencing.json").write_text("{not json")
    html = _client(None).get("/clusters").text
    assert "The cluster state could not be read: FencingError: the fence file" in html and "is not valid JSON" in html
    assert _forms(html) == {}  # no form is offered on a state that cannot be read


# -- the form's script, run in node with a stand-in DOM and fetch ---------------------------------
_HARNESS = """
const input = JSON.parse(process.argv[2]);
const calls = [];
function node(tag) {
  return {tag, textContent: "", children: [], disabled: false, href: "", target: "", listeners: {},
          addEventListener(type, fn) { this.listeners[type] = fn; },
          replaceChildren(...kids) { this.children = kids;
            this.textContent = kids.map((k) => typeof k === "string" ? k : k.textContent).join(""); }};
}
const forms = input.forms.map((f) => {
  const out = node("span"), button = node("button");
  const field = f.reason === null ? null : {value: input.reason};
  return {dataset: {action: f.action, cluster: f.cluster}, listeners: {}, out, button,
          addEventListener(type, fn) { this.listeners[type] = fn; },
          querySelector(sel) { return {".outcome": out, "button": button, "input[name=reason]": field}[sel]; }};
});
globalThis.document = {baseURI: input.baseURI, createElement: node,
                       querySelectorAll: (sel) => sel === "form.declare" ? forms : []};
globalThis.fetch = async (url, init) => {
  calls.push({url: String(url), init});
  return {ok: input.status < 300, status: input.status, json: async () => input.response};
};
// The Airflow UI framing the page (same origin) or the page on its own; "navigated" is what a click does.
const origin = new URL(input.baseURI).origin;
const navigated = [];
const ui = {location: {origin}, history: {pushState: (state, title, url) => navigated.push(["pushState", url])},
            dispatchEvent: (event) => navigated.push(["dispatch", event.type]),
            PopStateEvent: class { constructor(type) { this.type = type; } }};
globalThis.window = {location: {origin}};
window.top = input.framed ? ui : window;
eval(input.script);
for (const f of forms) await f.listeners.submit({preventDefault() {}});
const link = (f) => f.out.children.find((k) => typeof k !== "string") || null;
for (const f of forms) {
  if (link(f)) link(f).listeners.click({preventDefault: () => navigated.push(["preventDefault"])});
}
console.log(JSON.stringify({calls, navigated, outcomes: forms.map((f) => ({text: f.out.textContent,
  disabled: f.button.disabled, href: link(f) && link(f).href, target: link(f) && link(f).target}))}));
"""


def _submit(html: str, cluster: str, *, reason: str, base: str, status: int = 200, response: dict | None = None,
            framed: bool = False, tmp_path: Path) -> dict:
    node_bin = shutil.which("node")
    if node_bin is None:
        pytest.skip("node is not installed: the form's script cannot be run")
    script = re.search(r"<script>(.*?)</script>", html, re.S).group(1)
    harness = tmp_path / "harness.mjs"
    harness.write_text(_HARNESS)
    arg = json.dumps({"script": script, "forms": [_forms(html)[cluster]], "reason": reason, "baseURI": base,
                      "framed": framed, "status": status, "response": response or {}})
    done = subprocess.run([node_bin, str(harness), arg], capture_output=True, text=True, timeout=30, check=True)
    return json.loads(done.stdout)


def test_declare_down_posts_a_cluster_fence_run_with_the_session_cookie_and_links_to_it(
        estate: Estate, state_dir: Path, tmp_path: Path) -> None:
    html = _client(lambda: cluster_view(estate, state_dir)).get("/clusters").text
    run_id = "manual__2027-03-01T08:00:00+00:00"
    out = _submit(html, "cloud-east", reason="  region outage  ", base="https://af.example/airflow/hybridflow/clusters",
                  response={"dag_run_id": run_id, "dag_id": "cluster_fence"}, tmp_path=tmp_path)
    [call] = out["calls"]
    assert call["url"] == "https://af.example/airflow/api/v2/dags/cluster_fence/dagRuns"  # under a base_url too
    assert call["init"]["method"] == "POST" and call["init"]["credentials"] == "same-origin"
    assert "Authorization" not in call["init"]["headers"]  # the UI session's _token cookie authenticates it
    assert call["init"]["headers"]["Content-Type"] == "application/json"
    assert json.loads(call["init"]["body"]) == {
        "logical_date": None, "conf": {"action": "down", "cluster": "cloud-east", "reason": "region outage"}}
    [done] = out["outcomes"]
    assert done["href"] == ("https://af.example/airflow/dags/cluster_fence/runs/"
                            "manual__2027-03-01T08%3A00%3A00%2B00%3A00") and done["target"] == "_top"
    assert done["text"].startswith(f"triggered run {run_id}")
    assert out["navigated"] == []  # the page on its own: the link itself opens the run


def test_framed_by_the_airflow_ui_the_run_link_moves_the_ui_to_the_run(
        estate: Estate, state_dir: Path, tmp_path: Path) -> None:
    # The UI's iframe sandbox has no allow-top-navigation: a target=_top click would be blocked there.
    html = _client(lambda: cluster_view(estate, state_dir)).get("/clusters").text
    out = _submit(html, "cloud-east", reason="region outage", base="http://localhost:8080/hybridflow/clusters",
                  response={"dag_run_id": "manual__1"}, framed=True, tmp_path=tmp_path)
    assert out["navigated"] == [["preventDefault"],
                                ["pushState", "http://localhost:8080/dags/cluster_fence/runs/manual__1"],
                                ["dispatch", "popstate"]]


def test_declare_up_sends_no_reason_and_a_refusal_is_shown_with_the_api_s_words(
        estate: Estate, state_dir: Path, tmp_path: Path) -> None:
    declare_down("onprem-a", "fire", by="alice", estate=estate, path=state_path(state_dir))
    html = _client(lambda: cluster_view(estate, state_dir)).get("/clusters").text
    out = _submit(html, "onprem-a", reason="", base="http://localhost:8080/hybridflow/clusters", status=403,
                  response={"detail": "Forbidden"}, tmp_path=tmp_path)
    [call] = out["calls"]
    assert call["url"] == "http://localhost:8080/api/v2/dags/cluster_fence/dagRuns"
    assert json.loads(call["init"]["body"])["conf"] == {"action": "up", "cluster": "onprem-a", "reason": None}
    assert out["outcomes"] == [{"text": "refused (HTTP 403): Forbidden", "disabled": False, "href": None,
                                "target": None}]


def test_a_blank_reason_is_refused_naming_the_field_and_nothing_is_posted(
        estate: Estate, state_dir: Path, tmp_path: Path) -> None:
    html = _client(lambda: cluster_view(estate, state_dir)).get("/clusters").text
    out = _submit(html, "cloud-east", reason="   ", base="http://localhost:8080/hybridflow/clusters",
                  tmp_path=tmp_path)
    assert out["calls"] == []
    assert out["outcomes"][0]["text"].startswith("reason: say why the cluster is declared down")


@pytest.mark.airflow
def test_the_clusters_page_is_in_the_plugin_and_needs_a_signed_in_user():
    from airflow import plugins_manager
    from airflow.api_fastapi.app import create_app as create_api_server

    plugins, _ = plugins_manager._get_plugins()
    ours = next(p for p in plugins if p.name == "hybridflow_ui")
    views = {v["url_route"]: v for v in ours.external_views}
    assert views["hybridflow-clusters"] == {"name": "Clusters & DR", "href": "/hybridflow/clusters",
                                            "destination": "nav", "category": "browse",
                                            "url_route": "hybridflow-clusters"}
    api = TestClient(create_api_server(apps="core"))
    assert api.get("/hybridflow/clusters").status_code == 401
    assert api.get("/hybridflow/api/clusters").status_code == 401
