"""The metrics-source table: each configured name picks its implementation, an unknown name is a
ConfigError naming the field and the valid names, and a pass through a source carries its Xid
counts and warnings to node findings and the task summary."""

from __future__ import annotations

import http.server
import logging
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from hybridflow.config import MeteringCluster, MeteringSettings, load_estate
from hybridflow.errors import ConfigError
from hybridflow.metering.collect import read_cluster
from hybridflow.metering.sources import (
    SOURCES,
    ExporterScrape,
    LocalSlots,
    MetricsSource,
    PrometheusRange,
    SourceReading,
    open_source,
)
from hybridflow.settings import REPO_ROOT

WRITTEN = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm-exporter-written"
END = datetime(2026, 5, 1, 12, 5, tzinfo=UTC)
WINDOW = timedelta(minutes=5)


@pytest.fixture(scope="module")
def estate():
    return load_estate(REPO_ROOT / "config", use_cache=False)


@pytest.fixture
def pages():
    """Serves the written pages at /<file name>."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            path = WRITTEN / self.path.lstrip("/")
            body = path.read_bytes() if path.suffix == ".prom" and path.is_file() else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_every_configurable_name_has_its_implementation(estate, tmp_path):
    assert set(SOURCES) == {"exporters", "local", "prometheus"}
    cluster = estate.clusters["onprem-a"]
    configs = {"exporters": MeteringCluster(source="exporters", exporters=["http://127.0.0.1:9/metrics"]),
               "local": MeteringCluster(source="local"),
               "prometheus": MeteringCluster(source="prometheus", prometheus_url="http://127.0.0.1:9")}
    kinds = {name: type(open_source(cluster, cfg, MeteringSettings(), state_dir=tmp_path))
             for name, cfg in configs.items()}
    assert kinds == {"exporters": ExporterScrape, "local": LocalSlots, "prometheus": PrometheusRange}
    assert all(issubclass(k, MetricsSource) for k in SOURCES.values())
    assert [name for name, k in SOURCES.items() if k.reads_past] == ["prometheus"]


def test_an_unknown_source_name_is_a_config_error_naming_the_field_and_the_choices(estate, tmp_path):
    snmp = MeteringCluster.model_construct(source="snmp", exporters=[], prometheus_url=None, conn_id=None,
                                           selector="", node=None)
    with pytest.raises(ConfigError) as info:
        read_cluster(estate.clusters["onprem-a"], MeteringSettings(clusters={}).model_copy(
            update={"clusters": {"onprem-a": snmp}}), window_end=END, window=WINDOW, now=END, state_dir=tmp_path)
    assert str(info.value) == ("metering.clusters.onprem-a.source: 'snmp' is not a metrics source; "
                               "use one of: exporters, local, prometheus")


def test_a_source_is_one_read_method(estate, tmp_path):
    class Fixed(MetricsSource):
        def read(self, *, window_end, window):
            return SourceReading(errors=[f"{self.cluster.name} until {window_end:%H:%M} over {window}"])

    with pytest.raises(TypeError):
        MetricsSource(estate.clusters["onprem-a"], MeteringCluster(source="local"), MeteringSettings(),
                      state_dir=tmp_path)  # abstract
    got = Fixed(estate.clusters["onprem-a"], MeteringCluster(source="local"), MeteringSettings(),
                state_dir=tmp_path).read(window_end=END, window=WINDOW)
    assert got.errors == ["onprem-a until 12:05 over 0:05:00"] and got.page.samples == []


def _metering(**clusters) -> MeteringSettings:
    return MeteringSettings(retries=0, connect_timeout_s=1, clusters=clusters)


def test_an_exporter_pass_turns_xid_counts_into_findings(estate, tmp_path, pages):
    metering = _metering(**{"onprem-a": MeteringCluster(
        source="exporters", exporters=[f"{pages}/h100x2_xid-count_window-5min.prom",
                                       f"{pages}/t400_xid-errors-active.prom"])})
    reading = read_cluster(estate.clusters["onprem-a"], metering, window_end=END, window=WINDOW, now=END,
                           state_dir=tmp_path)
    assert reading.errors == [] and reading.warnings == [] and len(reading.samples) == 3
    assert [(f.node, f.xid_codes, f.probe_ok) for f in reading.findings] == [
        ("gpu-node-7", (13, 79), True), ("workstation", (42,), True)]
    assert [c.xid for c in reading.xid_counts] == [13, 79, 42]


def test_pages_metering_cannot_use_are_warnings_not_failed_probes(estate, tmp_path, pages, caplog):
    caplog.set_level(logging.WARNING, logger="hybridflow.metering")
    metering = _metering(**{"onprem-a": MeteringCluster(
        source="exporters", exporters=[f"{pages}/a100x2_no-hostname.prom", f"{pages}/l40s_clocks-and-pcie-only.prom"])})
    reading = read_cluster(estate.clusters["onprem-a"], metering, window_end=END, window=WINDOW, now=END,
                           state_dir=tmp_path)
    assert reading.samples == [] and reading.errors == [] and reading.findings == []
    nodeless, bare = reading.warnings
    assert nodeless.startswith(f"{pages}/a100x2_no-hostname.prom: 2 GPU(s)") and "Hostname" in nodeless
    assert bare.startswith(f"{pages}/l40s_clocks-and-pcie-only.prom: 2 GPU(s) (edge-3/")
    assert [r.getMessage() for r in caplog.records] == [nodeless, bare]
    # with the node named, the page without Hostname is read, its Xid count included
    named = _metering(**{"onprem-a": MeteringCluster(
        source="exporters", exporters=[f"{pages}/a100x2_no-hostname.prom"], node="a100-box")})
    reading = read_cluster(estate.clusters["onprem-a"], named, window_end=END, window=WINDOW, now=END,
                           state_dir=tmp_path)
    assert reading.warnings == [] and [(f.node, f.xid_codes) for f in reading.findings] == [("a100-box", (48,))]


def test_task_summary_carries_the_warnings(tmp_path, pages, monkeypatch):
    import yaml

    from hybridflow.metering.task import meter_cluster

    config = tmp_path / "config"
    config.mkdir()
    for name in ("clusters.yaml", "projects.yaml"):
        (config / name).write_text((REPO_ROOT / "config" / name).read_text())
    pipeline = yaml.safe_load((REPO_ROOT / "config" / "pipeline.yaml").read_text())
    pipeline["metering"].update(retries=0, clusters={"cloud-east": {
        "source": "exporters", "exporters": [f"{pages}/l40s_clocks-and-pcie-only.prom"]}})
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
    stored, reported = [], []
    summary = meter_cluster("cloud-east", window_start=END - WINDOW, window_end=END, now=END, lookup=None,
                            sinks=(lambda s, o: stored.extend(s) or 0, reported.extend))
    assert summary["samples"] == 0 and summary["errors"] == [] and stored == [] and reported == []
    (warning,) = summary["warnings"]
    assert "carry none of the fields metering reads" in warning


def test_an_unreachable_prometheus_is_an_error_of_the_pass_even_for_a_past_window(estate, tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        metering = _metering(**{"onprem-a": MeteringCluster(source="prometheus", prometheus_url=url)})
        reading = read_cluster(estate.clusters["onprem-a"], metering, window_end=END, window=WINDOW,
                               now=END + timedelta(days=2), state_dir=tmp_path)
    assert reading.skipped is None and reading.samples == [] and reading.findings == []
    (error,) = reading.errors
    assert error.startswith(f"{url}/api/v1/query_range: Prometheus did not answer")


def test_exporters_on_a_connection_need_a_lookup(estate, tmp_path):
    from hybridflow.metering.dcgm import DcgmError

    metering = _metering(**{"onprem-a": MeteringCluster(source="exporters", conn_id="dcgm_a", exporters=["/metrics"])})
    with pytest.raises(DcgmError, match="connection 'dcgm_a' is configured but no connection lookup"):
        read_cluster(estate.clusters["onprem-a"], metering, window_end=END, window=WINDOW, now=END,
                     state_dir=tmp_path)


def test_the_configuration_accepts_exactly_the_names_in_the_table():
    from typing import get_args

    assert set(get_args(MeteringCluster.model_fields["source"].annotation)) == set(SOURCES)
