"""The DR drills page: every drill kept in private storage, newest first, its figures beside the
targets, missed steps named, names escaped, an unreadable report said so, and the empty page."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from hybridflow.dr.drills.report import Targets, history, report_path, update_report
from hybridflow.ui.drills import add_drill_pages


def _client(root: Path) -> TestClient:
    app = FastAPI()
    add_drill_pages(app, source=lambda: history(root), authorize=False)
    return TestClient(app)


def _drill(root: Path, name: str, declared_at: str, figures: dict, missed: list[str], **extra) -> None:
    update_report(root, name, declared_at=declared_at, primary="onprem-a", dr_cluster="dr-west",
                  checkpoint_interval_steps=10, targets=Targets().to_dict(), figures=figures, missed=missed,
                  verdict="missed" if missed else "met", **extra)


def test_the_history_shows_each_drill_s_figures_against_its_targets_newest_first(tmp_path: Path) -> None:
    _drill(tmp_path, "scheduled__2027-01-01", "2027-01-01T06:00:01+00:00",
           {"inference_rto_s": 8.04, "training_rto_s": 9.5, "rpo_steps_lost": 10, "rpo_dataset_age_s": 1800.0}, [])
    _drill(tmp_path, "manual__<script>", "2027-02-03T10:00:00+00:00",
           {"inference_rto_s": 75.0, "training_rto_s": None, "rpo_steps_lost": 0, "rpo_dataset_age_s": None},
           ["inference: serving the replicated model on the DR cluster: took 75.0 s after the declaration, "
            "target inference_rto_s <= 60 s"])
    html = _client(tmp_path).get("/drills").text
    assert "<h1>DR drills</h1>" in html and "inference RTO ≤ 60 s, training RTO ≤ 120 s" in html
    assert html.index("manual__&lt;script&gt;") < html.index("scheduled__2027-01-01")  # newest first
    assert "<script>" not in html
    assert "<tr class='met'><td>scheduled__2027-01-01</td>" in html
    assert "8.0 s <span class='muted'>(≤ 60 s)</span>" in html and "10 steps <span class='muted'>(≤ 10 steps)" in html
    assert "<tr class='missed'>" in html and "<li>inference: serving the replicated model on the DR cluster: took " \
                                             "75.0 s after the declaration" in html
    body = _client(tmp_path).get("/api/drills").json()
    assert [d["drill"] for d in body["drills"]] == ["manual__<script>", "scheduled__2027-01-01"]


def test_no_drill_yet_and_an_unreadable_report_are_said(tmp_path: Path) -> None:
    assert "No drill yet: trigger the dr_drill DAG" in _client(tmp_path).get("/drills").text
    path = report_path(tmp_path, "broken")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    html = _client(tmp_path).get("/drills").text
    assert "<td>broken</td><td colspan='8'>unreadable report:" in html
