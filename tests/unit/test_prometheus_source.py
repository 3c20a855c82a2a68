"""The Prometheus source against a real Prometheus server scraping fixture exporters on loopback."""

from __future__ import annotations

import http.server
import logging
import shutil
import socket
import subprocess
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import requests
from tests.reference import DCGM_SAMPLES

from hybridflow.config import load_estate
from hybridflow.metering.dcgm import DcgmError, ExporterUnreachable, ScrapeSettings, parse_metrics
from hybridflow.metering.local_exporter import LocalExporterServer, LocalSlotExporter
from hybridflow.metering.prometheus import MAX_POINTS, PrometheusSource, aligned_window
from hybridflow.settings import REPO_ROOT

SAMPLES = DCGM_SAMPLES
PAGES = (SAMPLES / "aicr_eks-H100x8_k8s-pod-labels_drv580.105.08.prom",
         SAMPLES / "lke_RTX4000Ada_k8s-pod-labels_xid-errmsg_drv580.95.05.prom",
         # Xid counts of a newer exporter (written in its format; see the folder's README)
         Path(__file__).resolve().parents[1] / "fixtures" / "dcgm-exporter-written" / "h100x2_xid-count_window-5min.prom")
PROMETHEUS = shutil.which("prometheus")
# the stand-in reports no temperature: the sample GPUs by temperature, the local slots by utilisation
WAIT_QUERY = 'count(DCGM_FI_DEV_GPU_TEMP) + count(DCGM_FI_DEV_GPU_UTIL{cluster="local"})'


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(text: str) -> http.server.ThreadingHTTPServer:
    body = text.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip("the prometheus binary is not installed (Debian package 'prometheus'; CI installs it)")
    root = tmp_path_factory.mktemp("prometheus")
    exporters = [_serve(page.read_text()) for page in PAGES]
    targets = ", ".join(f"'127.0.0.1:{s.server_address[1]}'" for s in exporters)
    # and the local stand-in exporter of an idle local cluster, as a Prometheus would scrape it
    estate = load_estate(REPO_ROOT / "config", use_cache=False)
    local = LocalExporterServer(LocalSlotExporter(root / "state", estate.clusters["onprem-a"], node="box")).start()
    local_target = local.url.removeprefix("http://").removesuffix("/metrics")
    (root / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: dcgm\n"
        "    honor_labels: true\n"
        f"    static_configs: [{{targets: [{targets}], labels: {{cluster: fixture}}}},\n"
        f"                     {{targets: ['{local_target}'], labels: {{cluster: local}}}}]\n"
    )
    port = _free_port()
    log = open(root / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited {proc.returncode}: {(root / 'prometheus.log').read_text()[-2000:]}")
            try:
                r = requests.get(f"{base}/api/v1/query", params={"query": WAIT_QUERY}, timeout=2)
                result = r.json()["data"]["result"]
                if result and result[0]["value"][1] == "15":  # 10 H100s + 1 RTX 4000 + 4 local slots
                    break
            except (requests.RequestException, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus did not scrape the fixtures within 60 s: {(root / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.25)
        time.sleep(2.5)  # a few more scrapes, so a short range has several points
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
        for server in exporters:
            server.shutdown()
            server.server_close()
        local.stop()


def test_range_query_gives_the_same_samples_as_scraping(prometheus):
    source = PrometheusSource(prometheus, selector='cluster="fixture"')
    start, end = aligned_window(datetime.now(UTC), timedelta(seconds=4), timedelta(seconds=1))
    samples = source.samples(cluster="fixture", start=start, end=end, step=timedelta(seconds=1))
    direct = {s.gpu_uuid: s for page in PAGES
              for s in parse_metrics(page.read_text(), cluster="fixture", ts=end)}
    instants = sorted({s.ts for s in samples})
    assert len(instants) >= 2 and all(t.tzinfo is not None and t.microsecond == 0 for t in instants)
    latest = {s.gpu_uuid: s for s in samples if s.ts == instants[-1]}
    assert set(latest) == set(direct)  # every GPU, once per instant
    for uuid, want in direct.items():
        got = latest[uuid]
        for name in ("node", "gpu_index", "gpu_model", "namespace", "pod", "container", "util_pct",
                     "mem_used_mib", "mem_free_mib", "power_w", "temp_c", "energy_mj", "xid"):
            assert getattr(got, name) == getattr(want, name), (uuid, name)
    h100 = latest["GPU-c4529c8d-69c4-b61d-e0bc-7b2460096005"]
    assert (h100.pod, h100.namespace, h100.power_w) == ("vllm-agg-0-vllmdecodeworker-s65j5", "dynamo-workload", 113.611)
    # the same window read again: the same keys (idempotent storage downstream)
    again = source.samples(cluster="fixture", start=start, end=end, step=timedelta(seconds=1))
    assert [s.key() for s in again] == [s.key() for s in samples]


def test_local_stand_in_exporter_through_prometheus(prometheus):
    source = PrometheusSource(prometheus, selector='cluster="local"')
    end = datetime.now(UTC)
    samples = source.samples(cluster="onprem-a", start=end - timedelta(seconds=3), end=end, step=timedelta(seconds=1))
    latest = max(s.ts for s in samples)
    now = [s for s in samples if s.ts == latest]
    assert [(s.gpu_uuid, s.gpu_model, s.node, s.util_pct, s.power_w) for s in now] == [
        (f"GPU-local-onprem-a-{i}", "A100-80GB", "box", 0.0, 60.0) for i in range(4)]


def test_selector_that_matches_nothing_gives_no_samples_and_says_so(prometheus, caplog):
    caplog.set_level(logging.WARNING, logger="hybridflow.metering.prometheus")
    source = PrometheusSource(prometheus, selector='cluster="elsewhere"')
    end = datetime.now(UTC)
    page = source.read(cluster="elsewhere", start=end - timedelta(seconds=3), end=end, step=timedelta(seconds=1))
    assert page.samples == [] and page.xid_counts == []
    (warning,) = page.warnings
    assert warning.startswith(f'{prometheus}: no dcgm-exporter series matched {{cluster="elsewhere"}} from ')
    assert [r.getMessage() for r in caplog.records] == [warning]


def test_xid_counts_through_prometheus_become_findings(prometheus, tmp_path):
    from hybridflow.config import MeteringCluster, MeteringSettings
    from hybridflow.metering.collect import read_cluster

    end = datetime.now(UTC)
    page = PrometheusSource(prometheus, selector='cluster="fixture"').read(
        cluster="fixture", start=end - timedelta(seconds=3), end=end, step=timedelta(seconds=1))
    assert page.warnings == [] and len({c.ts for c in page.xid_counts}) >= 2  # at every step
    assert {(c.node, c.xid, c.count, c.window_ms) for c in page.xid_counts} == {
        ("gpu-node-7", 13, 1, 300000), ("gpu-node-7", 79, 2, 300000)}
    metering = MeteringSettings(prometheus_step_s=1, clusters={"onprem-a": MeteringCluster(
        source="prometheus", prometheus_url=prometheus, selector='cluster="fixture"')})
    cluster = load_estate(REPO_ROOT / "config", use_cache=False).clusters["onprem-a"]
    reading = read_cluster(cluster, metering, window_end=end, window=timedelta(seconds=4), now=end,
                           state_dir=tmp_path)
    assert {f.node: f.xid_codes for f in reading.findings} == {
        "gpu-node-1": (), "gpu-node-7": (13, 79), "lke529760-766837-0a634ab30000": ()}


def test_bad_selector_is_refused_with_prometheus_reason(prometheus):
    source = PrometheusSource(prometheus, selector='cluster=~"(')
    end = datetime.now(UTC)
    with pytest.raises(DcgmError, match="failed: HTTP 400 bad_data"):
        source.samples(cluster="x", start=end - timedelta(seconds=3), end=end, step=timedelta(seconds=1))


def test_unreachable_prometheus_and_long_ranges():
    port = _free_port()
    source = PrometheusSource(f"http://127.0.0.1:{port}", settings=ScrapeSettings(connect_timeout_s=1, retries=1, backoff_s=0.01))
    end = datetime(2026, 1, 2, tzinfo=UTC)
    with pytest.raises(ExporterUnreachable, match="Prometheus did not answer"):
        source.samples(cluster="x", start=end - timedelta(minutes=1), end=end, step=timedelta(seconds=15))
    chunks = list(source._chunks(0.0, 3 * MAX_POINTS * 60.0, 60.0))
    assert all((hi - lo) / 60 + 1 <= MAX_POINTS for lo, hi in chunks)
    assert chunks[0][0] == 0.0 and chunks[-1][1] == 3 * MAX_POINTS * 60.0
    assert all(b[0] - a[1] == 60.0 for a, b in zip(chunks, chunks[1:], strict=False))  # no gap, no overlap
    assert aligned_window(datetime(2026, 1, 1, 0, 7, 31, tzinfo=UTC), timedelta(minutes=5), timedelta(minutes=1)) == (
        datetime(2026, 1, 1, 0, 2, tzinfo=UTC), datetime(2026, 1, 1, 0, 7, tzinfo=UTC))
    with pytest.raises(DcgmError, match="http"):
        PrometheusSource("prom:9090")
