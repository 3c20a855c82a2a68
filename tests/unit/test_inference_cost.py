"""Inference is costed: the serving meter samples every model version that serves (a slot per model
server process on this machine, replicas x GPUs on Kubernetes), and the nightly allocation shows the
cost per project and model version next to training, in the ledger, the report and the costs page."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text
from tests.support.k8s_config import private_h100_cluster
from tests.support.k8s_sim_api import crd_validator, to_model
from tests.support.k8s_sim_kserve import CRD
from tests.support.ledger_db import ledger_engine  # noqa: F401 (fixture)
from tests.unit.test_ledger_runs import make_record

from hybridflow.config import KubernetesServing, NodePool, ServingSettings, load_estate
from hybridflow.ledger import ingest_run_record
from hybridflow.ledger.allocation import allocate_day
from hybridflow.ledger.inference import UNATTRIBUTED, metered_cost, store_serving_samples
from hybridflow.ledger.models import ServingSampleRow
from hybridflow.metering import serving as meter
from hybridflow.metering.serving import (
    KSERVE,
    SERVER_MODULE,
    kubernetes_samples,
    local_samples,
    meter_serving,
)
from hybridflow.serving import k8s_manifests
from hybridflow.serving.deploy import SERVER_MODULE as STARTED_MODULE
from hybridflow.serving.k8s_manifests import InferencePool, Release, canary_deployment, stable_deployment
from hybridflow.serving.kserve_manifests import SERVING_ANNOTATION, inference_service
from hybridflow.settings import REPO_ROOT, get_settings

DAY = date(2026, 11, 3)
MIDNIGHT = datetime(2026, 11, 3, tzinfo=UTC)
V1 = "hybrid-training-r1-abc"  # a pipeline run the ledger knows (project digits-ocr)
V2 = "hybrid-training-r9-new"  # a version of no known run
SLOT_PRICE = 0.5
WINDOW = timedelta(minutes=30)


def _version(serving: Path, endpoint: str, version: str, **fields) -> Path:
    path = serving / endpoint / "versions" / f"{version}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"endpoint": endpoint, "version": version, "model": "digits-cnn", **fields}))
    return path


@pytest.fixture
def fake_server(tmp_path):
    """A process whose command line is the model server's for a version's ready file, as the local
    deploy target starts it; stopped by its pid afterwards."""
    procs = []

    def start(ready: Path) -> int:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", SERVER_MODULE, str(ready)])
        procs.append(proc)
        return proc.pid

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


def _meter_day(serving_root: Path, engine, *, day_start: datetime = MIDNIGHT) -> None:
    """Every metering window of the day, as the gpu_metering DAG runs them."""
    estate = SimpleNamespace(pipeline=SimpleNamespace(serving=ServingSettings(slot_price_per_hour=SLOT_PRICE)))

    def store(samples, **window):
        return store_serving_samples(samples, engine=engine, **window)

    start = day_start
    while start < day_start + timedelta(days=1):
        meter_serving(store, window_start=start, window_end=start + WINDOW, now=start + WINDOW, estate=estate,
                      state_dir=serving_root.parent)
        start += WINDOW


def _two_versions_over_a_day(tmp_path: Path, fake_server) -> Path:
    """v1 served from the day before until 12:10; v2 started at 12:00 and still serves: both in the
    12:00-12:30 window (the canary's)."""
    serving = tmp_path / "state" / "serving"
    _version(serving, "digits", V1, pid=999_999_999, status="stopped", started_at="2026-11-02T20:00:00+00:00",
             activated_at="2026-11-02T20:01:00+00:00", stopped_at="2026-11-03T12:10:00+00:00")
    v2 = serving / "digits" / "versions" / f"{V2}.json"
    _version(serving, "digits", V2, status="active", started_at="2026-11-03T12:00:00+00:00",
             activated_at="2026-11-03T12:05:00+00:00", pid=fake_server(v2.with_suffix(".ready")))
    return serving


def _inference_rows(engine) -> list[tuple]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(
            "SELECT day, project, team, model, endpoint, version, cluster, unit, unit_hours, usd_per_unit_hour, "
            "cost_usd FROM inference_allocation ORDER BY project, version"))]


def test_two_versions_over_a_day_are_costed_per_version_and_project_and_a_re_run_changes_nothing(
        ledger_engine, tmp_path, fake_server):  # noqa: F811
    engine = ledger_engine
    ingest_run_record(make_record(), engine=engine)  # V1's run: digits-ocr / vision, training on the same day
    serving = _two_versions_over_a_day(tmp_path, fake_server)
    _meter_day(serving, engine)
    with engine.connect() as conn:
        both = conn.execute(select(ServingSampleRow.version).where(
            ServingSampleRow.window_start == datetime(2026, 11, 3, 12, 0))).scalars().all()
        count = conn.execute(select(func.count()).select_from(ServingSampleRow)).scalar_one()
    assert sorted(both) == [V1, V2]  # the canary window costs both versions
    assert count == 25 + 24  # v1 in 00:00..12:30 (25 windows), v2 in 12:00..24:00 (24)

    private = tmp_path / "private"
    estate = load_estate(get_settings().config_dir)
    summary = allocate_day(DAY, engine=engine, estate=estate, private_root=private, as_of=DAY)
    v1_hours, v2_hours = 12 + 10 / 60, 12.0
    assert _inference_rows(engine) == [
        ("2026-11-03", "digits-ocr", "vision", "digits-cnn", "digits", V1, "local", "slot",
         pytest.approx(v1_hours), pytest.approx(SLOT_PRICE), pytest.approx(v1_hours * SLOT_PRICE)),
        ("2026-11-03", UNATTRIBUTED, "", "digits-cnn", "digits", V2, "local", "slot",
         pytest.approx(v2_hours), pytest.approx(SLOT_PRICE), pytest.approx(v2_hours * SLOT_PRICE)),
    ]
    # The lines add up to what was metered, and sit next to the training cost of the same day.
    assert summary["inference_cost_usd"] == pytest.approx(metered_cost(engine, DAY)) == \
        pytest.approx((v1_hours + v2_hours) * SLOT_PRICE)
    assert summary["cost_usd"] > 0 and summary["inference_lines"] == 2
    report = (private / "reports" / "allocation" / DAY.isoformat() / "report.html").read_text()
    assert "Inference cost per project and model version" in report
    assert f"<td>{UNATTRIBUTED}</td><td></td><td>digits-cnn</td><td>{V2}</td>" in report
    assert (private / "reports" / "allocation" / DAY.isoformat() / "inference.parquet").is_file()

    # Metering the day and allocating the night again change nothing.
    before = _inference_rows(engine)
    _meter_day(serving, engine)
    allocate_day(DAY, engine=engine, estate=estate, private_root=private, as_of=DAY, report=False)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(ServingSampleRow)).scalar_one() == count
    assert _inference_rows(engine) == before


def test_a_version_known_only_from_its_run_record_is_costed_to_its_project(ledger_engine, tmp_path):  # noqa: F811
    engine = ledger_engine
    serving = tmp_path / "state" / "serving"
    _version(serving, "ranker", "hybrid-training-r7-xyz", model=None, pid=1, status="stopped",
             started_at="2026-11-03T06:00:00+00:00", stopped_at="2026-11-03T07:30:00+00:00")
    record = tmp_path / "private" / "records" / "ranking" / "hybrid-training-r7-xyz.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"run_key": "hybrid-training-r7-xyz", "project": "ranking", "team": "search",
                                  "model": "ranker-mlp"}))
    _meter_day(serving, engine)
    allocate_day(DAY, engine=engine, estate=load_estate(get_settings().config_dir), private_root=tmp_path / "private",
                 as_of=DAY, report=False)
    assert _inference_rows(engine) == [("2026-11-03", "ranking", "search", "ranker-mlp", "ranker",
                                        "hybrid-training-r7-xyz", "local", "slot", pytest.approx(1.5),
                                        pytest.approx(SLOT_PRICE), pytest.approx(0.75))]


def test_a_server_gone_without_a_stop_noted_is_not_charged_and_a_window_crossing_midnight_is_shared(tmp_path):
    serving = tmp_path / "serving"
    _version(serving, "digits", "crashed", pid=999_999_999, status="active", started_at="2026-11-03T10:00:00+00:00")
    _version(serving, "digits", "late", pid=1, status="stopped", started_at="2026-11-03T23:50:00+00:00",
             stopped_at="2026-11-04T00:10:00+00:00")
    window = {"window_start": datetime(2026, 11, 3, 23, 45, tzinfo=UTC), "window_end": datetime(2026, 11, 4, 0, 15,
                                                                                                tzinfo=UTC)}
    samples = local_samples(serving, usd_per_slot_hour=1.0, **window)
    assert [(s.version, s.unit_hours) for s in samples] == [("late", pytest.approx(20 / 60))]


def _sim_hook(*, deployments=(), services=()) -> SimpleNamespace:
    """KubernetesHook's clients as the cluster simulator's fakes answer: the client's model objects for
    Deployments, dicts for custom objects, filtered by the label selector."""
    def deps(namespace, label_selector=None, **_):
        listed = [d for d in deployments if label_selector in d["metadata"]["labels"]]
        return to_model({"apiVersion": "apps/v1", "kind": "DeploymentList", "metadata": {}, "items": listed},
                        "V1DeploymentList")

    def customs(group, version, namespace, plural, label_selector=None, **_):
        assert (group, version, plural) == KSERVE
        return {"items": [s for s in services if label_selector in s["metadata"]["labels"]]}

    return SimpleNamespace(apps_v1_client=SimpleNamespace(list_namespaced_deployment=deps),
                           custom_object_client=SimpleNamespace(list_namespaced_custom_object=customs))


def _k8s_estate(kind: str) -> SimpleNamespace:
    k8s = KubernetesServing(cluster="dc2-k8s", node_pool="h100", image="registry.local/serve:1",
                            models_claim="private-models", models_dir="/mnt/models", replicas=4, gpus_per_replica=2,
                            kind=kind)
    return SimpleNamespace(pipeline=SimpleNamespace(serving=ServingSettings(kubernetes=k8s)),
                           clusters={"dc2-k8s": private_h100_cluster("volcano")})


def test_kubernetes_deployments_count_replicas_times_gpus_at_the_pools_price():
    pool = InferencePool(endpoint="digits", namespace="hybridflow-serving", models_claim="private-models", replicas=4,
                         gpus_per_replica=2, pool=NodePool(name="h100", gpu_model="H100-80GB", gpu_memory_gib=80,
                                                           gpus=8))
    stable = stable_deployment(pool, Release(V1, "int8", "registry.local/serve:1"))
    canary = canary_deployment(pool, Release(V2, "fp16", "registry.local/serve:1"), 25)
    stable["status"] = {"replicas": 4}  # what runs; the canary's status is not reported yet: its spec counts
    start = datetime(2026, 11, 3, 12, 0, tzinfo=UTC)
    samples = kubernetes_samples(_sim_hook(deployments=[stable, canary]), _k8s_estate("deployment"),
                                 window_start=start, window_end=start + timedelta(minutes=5))
    got = {s.version: (s.cluster, s.unit, s.units, s.unit_hours, s.gpu_model, s.pricing_class, s.usd_per_unit_hour)
           for s in samples}
    canary_gpus = canary["spec"]["replicas"] * 2
    assert got == {V1: ("dc2-k8s", "gpu", 8.0, pytest.approx(8 * 5 / 60), "H100-80GB", "onprem", 1.1),
                   V2: ("dc2-k8s", "gpu", float(canary_gpus), pytest.approx(canary_gpus * 5 / 60), "H100-80GB",
                        "onprem", 1.1)}


def _inference_service(version: str, *, canary: int | None, serving: str,
                       traffic: list[tuple[str, int, str]]) -> dict:
    """As the KServe deploy target writes it (the new version in the labels, the one taking all traffic
    until promotion in the serving-version annotation) with the predictor's status as KServe reports
    it; valid against the KServe v0.20.0 CRD."""
    pool = InferencePool(endpoint="digits", namespace="hybridflow-serving", models_claim="private-models", replicas=3,
                         gpus_per_replica=1, pool=NodePool(name="h100", gpu_model="H100-80GB", gpu_memory_gib=80,
                                                           gpus=8))
    isvc = inference_service(pool, Release(version, "int8", "registry.local/serve:1"), canary_percent=canary,
                             serving_version=serving)
    latest = traffic[0][0] if traffic[0][2] == "latest" else "digits-predictor-00009"
    isvc["metadata"]["generation"] = 1
    isvc["status"] = {"observedGeneration": 1, "components": {"predictor": {
        "latestCreatedRevision": latest,
        "traffic": [{"revisionName": r, "percent": p, "tag": tag, "latestRevision": r == latest} for r, p, tag in traffic],
    }}}
    crd_validator(*CRD).validate(isvc)
    return isvc


def test_an_inference_service_costs_its_predictor_and_during_a_canary_the_rolled_out_revision_too():
    start = datetime(2026, 11, 3, 12, 0, tzinfo=UTC)
    window = {"window_start": start, "window_end": start + timedelta(minutes=5)}
    estate = _k8s_estate("kserve")
    first = _inference_service(V1, canary=None, serving=V1, traffic=[("digits-predictor-00001", 100, "latest")])
    samples = kubernetes_samples(_sim_hook(services=[first]), estate, **window)
    assert [(s.version, s.units, s.usd_per_unit_hour) for s in samples] == [(V1, 3.0, 1.1)]
    in_canary = _inference_service(V2, canary=10, serving=V1, traffic=[("digits-predictor-00002", 10, "latest"),
                                                                       ("digits-predictor-00001", 90, "prev")])
    samples = kubernetes_samples(_sim_hook(services=[in_canary]), estate, **window)
    assert {s.version: s.units for s in samples} == {V1: 3.0, V2: 3.0}
    # A new revision not ready yet takes no traffic, but its pods start: both are costed.
    starting = _inference_service(V2, canary=10, serving=V1, traffic=[("digits-predictor-00001", 100, "prev")])
    assert {s.version for s in kubernetes_samples(_sim_hook(services=[starting]), estate, **window)} == {V1, V2}
    promoted = _inference_service(V2, canary=None, serving=V2, traffic=[("digits-predictor-00002", 100, "latest")])
    samples = kubernetes_samples(_sim_hook(services=[promoted]), estate, **window)
    assert [(s.version, s.units) for s in samples] == [(V2, 3.0)]


def test_a_kubernetes_window_long_over_is_skipped_not_read_as_the_present():
    start = datetime(2026, 11, 3, 12, 0, tzinfo=UTC)
    stored = []
    summary = meter_serving(lambda samples, **w: stored.append(samples) or 0, window_start=start,
                            window_end=start + timedelta(minutes=5), now=start + timedelta(hours=1),
                            estate=_k8s_estate("deployment"), hook=_sim_hook())
    assert stored == [] and "the API shows only what serves now" in summary["skipped"]


def test_the_costs_page_shows_the_inference_lines_of_the_latest_day(tmp_path):
    from hybridflow.ledger.allocation import REPORTS, write_files
    from hybridflow.storage.objectstore import LocalObjectStore
    from hybridflow.ui.costs import add_cost_pages

    private = tmp_path / "private"
    lines = [{"day": "2026-11-03", "project": "digits-ocr", "team": "vision", "model": "digits-cnn",
              "endpoint": "digits", "version": V1, "cluster": "dc2-k8s", "unit": "gpu", "unit_hours": 24.0,
              "usd_per_unit_hour": 1.1, "cost_usd": 26.4},
             {"day": "2026-11-03", "project": UNATTRIBUTED, "team": "", "model": "(unknown)", "endpoint": "digits",
              "version": V2, "cluster": "local", "unit": "slot", "unit_hours": 2.0, "usd_per_unit_hour": 0.5,
              "cost_usd": 1.0}]
    store = LocalObjectStore(private)
    write_files(store, f"{REPORTS.as_posix()}/2026-11-03", [], [], [], lines)
    store.put_bytes(f"{REPORTS.as_posix()}/2026-11-03/report.html", b"<html></html>")
    app = FastAPI()
    add_cost_pages(app, private_root=private, config_dir=REPO_ROOT / "config", store_factory=lambda: None,
                   today=lambda: date(2026, 11, 4), authorize=False)
    html = TestClient(app).get("/costs").text
    assert "Inference cost per project and model version, 2026-11-03" in html
    assert (f"<tr><td>digits-ocr</td><td>vision</td><td>digits-cnn</td><td>{V1}</td><td>digits</td>"
            "<td>dc2-k8s</td><td>GPU</td><td>24.00</td><td>1.1000</td><td>26.40</td></tr>") in html
    assert f"<td>{UNATTRIBUTED}</td>" in html and "inference in all</th><th>27.40</th>" in html


def test_the_meter_reads_the_labels_and_the_process_the_deploy_targets_write(tmp_path):
    from hybridflow.serving.deploy import _ready_file

    # A local server is told by its command line: the ready file the deploy passed it is its record's sibling.
    record = tmp_path / "digits" / "versions" / "run.v1.2.json"
    assert _ready_file(tmp_path / "digits", "run.v1.2") == record.with_suffix(".ready")
    assert (meter.ENDPOINT_LABEL, meter.VERSION_LABEL, meter.GPU_RESOURCE, meter.SERVER_MODULE,
            meter.SERVING_VERSION_ANNOTATION) == (k8s_manifests.ENDPOINT_LABEL, k8s_manifests.VERSION_LABEL,
                                                  k8s_manifests.GPU_RESOURCE, STARTED_MODULE, SERVING_ANNOTATION)


def test_a_training_runs_cost_page_shows_what_its_model_version_cost_to_serve(tmp_path):
    from hybridflow.ledger.allocation import REPORTS, write_files
    from hybridflow.records import write_record
    from hybridflow.runs import RunIdentity
    from hybridflow.storage.objectstore import LocalObjectStore
    from hybridflow.ui.costs import add_cost_pages

    run_id = "manual__2026-11-02T10:00:00+00:00"
    version = RunIdentity("hybrid_training", run_id).run_key  # what a pipeline deploy names the version
    private = tmp_path / "private"
    write_record(private, {"run_key": version, "dag_id": "hybrid_training", "run_id": run_id, "project": "digits-ocr",
                           "team": "vision", "gpu_hours": 1.0, "price_per_gpu_hour": 1.2, "model_version": version,
                           "recorded_at": "2026-11-02T12:00:00+00:00"})

    def line(day: str, v: str, hours: float) -> dict:
        return {"day": day, "project": "digits-ocr", "team": "vision", "model": "digits-cnn", "endpoint": "digits",
                "version": v, "cluster": "local", "unit": "slot", "unit_hours": hours, "usd_per_unit_hour": 0.5,
                "cost_usd": hours * 0.5}

    store = LocalObjectStore(private)
    write_files(store, f"{REPORTS.as_posix()}/2026-11-02", [], [], [], [line("2026-11-02", version, 12.0)])
    write_files(store, f"{REPORTS.as_posix()}/2026-11-03", [], [], [],
                [line("2026-11-03", version, 10.0), line("2026-11-03", "another-version", 14.0)])
    app = FastAPI()
    add_cost_pages(app, private_root=private, config_dir=REPO_ROOT / "config", store_factory=lambda: None,
                   today=lambda: date(2026, 11, 4), authorize=False)
    html = TestClient(app).get(f"/costs/runs/hybrid_training/{run_id}").text
    assert "Inference cost of its model version" in html
    assert "<tr><td>2026-11-02</td><td>digits</td><td>local</td><td>slot</td><td>12.00</td><td>6.0000</td></tr>" in html
    assert "<td>2026-11-03</td>" in html and "inference in all</th><th>11.0000</th>" in html  # not another-version's
