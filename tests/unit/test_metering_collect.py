"""A metering pass per cluster: configured sources, failed probes, stale windows, node findings,
attribution to runs, and the metering section of pipeline.yaml."""

from __future__ import annotations

import base64
import http.server
import json
import shutil
import socket
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from tests.reference import DCGM_SAMPLES
from tests.support.k8s_config import as_kubernetes

from hybridflow.config import MeteringSettings, load_estate
from hybridflow.errors import ConfigError
from hybridflow.metering.collect import (
    Endpoint,
    attribute,
    known_gangs,
    node_findings,
    read_cluster,
    run_key_of,
    source_of,
)
from hybridflow.metering.dcgm import parse_metrics
from hybridflow.settings import REPO_ROOT

SAMPLES = DCGM_SAMPLES
H100 = (SAMPLES / "aicr_eks-H100x8_k8s-pod-labels_drv580.105.08.prom").read_text()
END = datetime(2026, 5, 1, 12, 5, tzinfo=UTC)
WINDOW = timedelta(minutes=5)


def _config(tmp_path: Path, clusters_mutate=None, metering: dict | None = None) -> Path:
    target = tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", target)
    if clusters_mutate:
        data = yaml.safe_load((target / "clusters.yaml").read_text())
        clusters_mutate(data)
        (target / "clusters.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    if metering is not None:
        data = yaml.safe_load((target / "pipeline.yaml").read_text()) or {}
        data["metering"] = metering
        (target / "pipeline.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return target


def _to_kubernetes(data: dict) -> None:
    as_kubernetes(data["clusters"]["onprem-a"], conn_id="k8s_onprem_a", scheduler="kueue")


@pytest.fixture
def exporter():
    """Serves the H100 sample page, only with basic auth ops:s3cret when `require_auth` is set."""
    state = {"require_auth": False, "paths": []}
    want = "Basic " + base64.b64encode(b"ops:s3cret").decode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            state["paths"].append(self.path)
            if state["require_auth"] and self.headers.get("Authorization") != want:
                self.send_response(401)
                self.end_headers()
                return
            body = H100.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"


def test_shipped_config_meters_local_clusters_from_their_slots():
    estate = load_estate(REPO_ROOT / "config", use_cache=False)
    metering = estate.pipeline.metering
    assert metering.clusters == {}
    assert {n: source_of(c, metering).source for n, c in estate.clusters.items()} == {
        "onprem-a": "local", "cloud-east": "local"}
    assert metering.schedule == "*/5 * * * *"


@pytest.mark.parametrize(("metering", "expected"), [
    ({"clusters": {"nowhere": {"source": "local"}}}, ["metering.clusters.nowhere", "no such cluster"]),
    ({"clusters": {"onprem-a": {"source": "exporters"}}}, ["metering.clusters.onprem-a", "needs exporters"]),
    ({"clusters": {"onprem-a": {"source": "prometheus"}}}, ["prometheus_url or conn_id"]),
    ({"clusters": {"onprem-a": {"source": "snmp"}}}, ["metering.clusters.onprem-a.source"]),
    ({"local_idle_w": 500, "local_busy_w": 100}, ["local_idle_w 500.0 is above local_busy_w"]),
    ({"retries": -1}, ["metering.retries"]),
])
def test_bad_metering_section_names_file_and_key(tmp_path, metering, expected):
    target = _config(tmp_path, metering=metering)
    with pytest.raises(ConfigError) as info:
        load_estate(target, use_cache=False)
    assert str(target / "pipeline.yaml") in str(info.value)
    for part in expected:
        assert part in str(info.value)


def test_local_source_on_a_kubernetes_cluster_is_refused(tmp_path):
    target = _config(tmp_path, _to_kubernetes, {"clusters": {"onprem-a": {"source": "local"}}})
    with pytest.raises(ConfigError, match="onprem-a.source: 'local' reads the local backend's slots"):
        load_estate(target, use_cache=False)


def test_exporters_with_one_node_down(tmp_path, exporter):
    _, base = exporter
    dead = _dead_url()
    target = _config(tmp_path, _to_kubernetes, {"retries": 0, "connect_timeout_s": 1, "clusters": {
        "onprem-a": {"source": "exporters", "exporters": [f"{base}/metrics", dead]}}})
    estate = load_estate(target, use_cache=False)
    reading = read_cluster(estate.clusters["onprem-a"], estate.pipeline.metering, window_end=END,
                           window=WINDOW, now=END + timedelta(seconds=3), state_dir=tmp_path / "state")
    assert len(reading.samples) == 8 and {s.ts for s in reading.samples} == {END}
    assert {s.cluster for s in reading.samples} == {"onprem-a"}
    (err,) = reading.errors
    assert dead in err
    ok, down = reading.findings
    assert (ok.node, ok.probe_ok, ok.xid_codes) == ("gpu-node-1", True, ())
    assert (down.node, down.probe_ok, down.cluster) == ("127.0.0.1", False, "onprem-a") and dead in down.detail


def test_exporter_urls_on_a_connection_with_credentials(tmp_path, exporter):
    state, base = exporter
    state["require_auth"] = True
    target = _config(tmp_path, _to_kubernetes, {"clusters": {
        "onprem-a": {"source": "exporters", "conn_id": "dcgm_onprem_a", "exporters": ["/metrics"]}}})
    estate = load_estate(target, use_cache=False)
    asked = []

    def lookup(conn_id):
        asked.append(conn_id)
        return Endpoint(base, ("ops", "s3cret"))

    reading = read_cluster(estate.clusters["onprem-a"], estate.pipeline.metering, window_end=END,
                           window=WINDOW, now=END, state_dir=tmp_path, lookup=lookup)
    assert asked == ["dcgm_onprem_a"] and reading.errors == [] and len(reading.samples) == 8
    assert "s3cret" not in repr(Endpoint(base, ("ops", "s3cret")))


def test_stale_window_and_unconfigured_kubernetes_cluster_are_skipped_with_a_reason(tmp_path):
    estate = load_estate(REPO_ROOT / "config", use_cache=False)
    reading = read_cluster(estate.clusters["onprem-a"], estate.pipeline.metering, window_end=END,
                           window=WINDOW, now=END + timedelta(hours=3), state_dir=tmp_path)
    assert reading.samples == [] and "only shows the present" in reading.skipped
    k8s = load_estate(_config(tmp_path, _to_kubernetes, {}), use_cache=False)
    reading = read_cluster(k8s.clusters["onprem-a"], MeteringSettings(), window_end=END, window=WINDOW,
                           now=END, state_dir=tmp_path)
    assert "add metering.clusters.onprem-a" in reading.skipped


def test_local_cluster_reads_its_idle_slots(tmp_path):
    estate = load_estate(REPO_ROOT / "config", use_cache=False)
    reading = read_cluster(estate.clusters["cloud-east"], estate.pipeline.metering, window_end=END,
                           window=WINDOW, now=END, state_dir=tmp_path / "state")
    assert [s.gpu_model for s in reading.samples] == ["H100-80GB"] * 4 + ["A100-80GB"] * 4
    assert all(s.pod is None and s.util_pct == 0 and s.ts == END for s in reading.samples)
    assert [f.probe_ok for f in reading.findings] == [True]


def test_node_findings_collect_xid_codes_and_ecc_totals():
    lines = []
    for gpu, (xid, sbe, dbe) in enumerate([(79, 3, 1), (0, 2, 0), (48, 0, 0), (79, 0, 0)]):
        labels = f'gpu="{gpu}",UUID="GPU-{gpu}",Hostname="{"n1" if gpu < 3 else "n2"}"'
        lines += [f"DCGM_FI_DEV_XID_ERRORS{{{labels}}} {xid}", f"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{{{labels}}} {sbe}",
                  f"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{labels}}} {dbe}"]
    older = parse_metrics("\n".join(lines).replace("} 79", "} 13") + "\n", cluster="c", ts=END - WINDOW)
    newer = parse_metrics("\n".join(lines) + "\n", cluster="c", ts=END)
    n1, n2 = node_findings(older + newer)  # the latest reading of each GPU counts
    assert (n1.node, n1.xid_codes, n1.ecc_sbe, n1.ecc_dbe, n1.probe_ok) == ("n1", (48, 79), 5, 1, True)
    assert (n2.node, n2.xid_codes) == ("n2", (79,))


def test_samples_are_attributed_to_the_run_whose_gang_holds_the_gpu():
    runs = {"hybrid_training__manual_1": "vision", "hybrid_training__manual_10": "nlp"}
    assert run_key_of("train-hybrid_training__manual_1", runs) == "hybrid_training__manual_1"
    assert run_key_of("train-hybrid_training__manual_10-worker-0", runs) == "hybrid_training__manual_10"
    assert run_key_of("vllm-agg-0", runs) is None and run_key_of(None, runs) is None
    page = (
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-0",Hostname="n",pod="train-hybrid_training__manual_1",namespace="vision"} 50\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-1",Hostname="n",pod="train-hybrid_training__manual_10-worker-1",namespace="hybridflow"} 50\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="2",UUID="GPU-2",Hostname="n",pod="train-hybrid_training__manual_1",namespace="other-team"} 50\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="3",UUID="GPU-3",Hostname="n"} 0\n'
    )
    samples = parse_metrics(page, cluster="c", ts=END)
    got = attribute(samples, runs, namespaces={"hybridflow"})
    assert got == {samples[0].key(): "hybrid_training__manual_1", samples[1].key(): "hybrid_training__manual_10"}


def test_kubernetes_gang_pods_are_attributed_by_the_job_name_the_run_recorded(tmp_path):
    # A Kubernetes job name is a DNS label from the run ("train-hybrid-training-manual-1-<hash>"),
    # not train-<run_key>: the train task records it in the run's attempts.
    run_folder = tmp_path / "runs" / "hybrid_training__manual_1"
    run_folder.mkdir(parents=True)
    (run_folder / "train-attempts.json").write_text(json.dumps(
        [{"attempt": "try-1", "gang": "train-hybrid-training-manual-1-0a1b2c3d4e"}]))
    (tmp_path / "runs" / "half-written").mkdir()
    (tmp_path / "runs" / "half-written" / "train-attempts.json").write_text("[{")
    gangs = known_gangs(tmp_path)
    assert gangs == {"train-hybrid-training-manual-1-0a1b2c3d4e": "hybrid_training__manual_1"}
    page = (
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-0",Hostname="n",pod="train-hybrid-training-manual-1-0a1b2c3d4e-master-0",namespace="hybridflow"} 90\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-1",Hostname="n",pod="train-hybrid-training-manual-1-0a1b2c3d4e-1-x7k2q",namespace="hybridflow"} 90\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="2",UUID="GPU-2",Hostname="n",pod="train-hybrid-training-manual-1-0a1b2c3d4e-1-x7k2q",namespace="elsewhere"} 90\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="3",UUID="GPU-3",Hostname="n",pod="train-hybrid-training-manual-1-ffffffffff-master-0",namespace="hybridflow"} 90\n'
    )
    samples = parse_metrics(page, cluster="c", ts=END)
    got = attribute(samples, {"hybrid_training__manual_1": "vision"}, namespaces={"hybridflow"}, gangs=gangs)
    assert got == {samples[0].key(): "hybrid_training__manual_1", samples[1].key(): "hybrid_training__manual_1"}
