"""dcgm-exporter parsing against every real sample page, and scraping over loopback HTTP."""

from __future__ import annotations

import http.server
import json
import logging
import threading
from datetime import UTC, datetime, timedelta, timezone

import pytest
from tests.reference import DCGM_SAMPLES

from hybridflow.cli import main as cli_main
from hybridflow.metering.dcgm import (
    DcgmError,
    ExporterUnreachable,
    MalformedMetrics,
    ScrapeSettings,
    fetch,
    is_blank,
    parse_metrics,
    scrape,
)

SAMPLES = DCGM_SAMPLES
TS = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def _parse(name: str):
    return parse_metrics((SAMPLES / name).read_text(), cluster="c1", ts=TS, source=name)


def test_every_sample_file_parses_to_one_record_per_gpu():
    counts = {p.name: len(parse_metrics(p.read_text(), cluster="c1", ts=TS)) for p in sorted(SAMPLES.glob("*.prom"))}
    assert len(counts) == 7, "a sample file was added or removed: extend these tests"
    assert counts == {
        "aicr_eks-H100x8_k8s-pod-labels_drv580.105.08.prom": 8,
        "k8s-ai-conformance_ericsson-ccd_T4-loaded_drv590.48.01.prom": 1,
        "k8s-ai-conformance_kops_aws-L4_drv580.105.08.prom": 1,
        "k8s-ai-conformance_upcloud_L40S_drv595.58.03.prom": 1,
        "k8s-ai-conformance_vks_vGPU-GRID-A100-10C_drv580.126.09.prom": 1,
        "lke_RTX4000Ada_k8s-pod-labels_xid-errmsg_drv580.95.05.prom": 1,
        "nvidia-cloud-native-docs_A100-MIG_dcgm-exporter-2.x.prom": 2,  # the GPU and its 1g.5gb instance
    }


def test_loaded_t4_without_help_lines_gives_every_metered_field():
    (s,) = _parse("k8s-ai-conformance_ericsson-ccd_T4-loaded_drv590.48.01.prom")
    assert (s.node, s.gpu_uuid, s.gpu_index, s.gpu_model) == (
        "cp-bm14r7", "GPU-6d5c0ac5-74d7-3130-46f1-e93ed57f469a", 0, "Tesla T4")
    assert (s.util_pct, s.mem_used_mib, s.mem_free_mib, s.power_w, s.temp_c) == (91.0, 5120.0, 9791.0, 68.244, 74.0)
    assert s.energy_mj == 15152422938.0
    assert (s.namespace, s.pod, s.container, s.xid) == (None, None, None, None)
    assert s.ts == TS and s.cluster == "c1"


def test_counter_families_with_type_lines_keep_their_values():
    # TYPE counter makes the parser call the sample `<name>_total`; energy must still be read
    (s,) = _parse("k8s-ai-conformance_kops_aws-L4_drv580.105.08.prom")
    assert s.energy_mj == 4742776.0 and s.power_w == 16.365 and s.mem_free_mib == 22563.0
    (s,) = _parse("k8s-ai-conformance_upcloud_L40S_drv595.58.03.prom")
    assert s.gpu_model == "NVIDIA L40S" and s.energy_mj == 5551899580.0


def test_pod_labels_attach_only_to_the_gpu_a_pod_holds():
    samples = _parse("aicr_eks-H100x8_k8s-pod-labels_drv580.105.08.prom")
    held = [s for s in samples if s.pod]
    assert [(s.gpu_index, s.namespace, s.pod, s.container) for s in held] == [
        (0, "dynamo-workload", "vllm-agg-0-vllmdecodeworker-s65j5", "main")]
    assert all(s.namespace is None and s.container is None for s in samples if s.gpu_index != 0)
    assert [s.gpu_index for s in samples] == list(range(8))
    assert samples[0].power_w == 113.611 and samples[7].temp_c == 26.0
    assert all(s.mem_used_mib is None for s in samples)  # not in this selection of lines: unknown, not 0


def test_xid_with_err_code_and_message_labels():
    (s,) = _parse("lke_RTX4000Ada_k8s-pod-labels_xid-errmsg_drv580.95.05.prom")
    assert s.xid == 0 and isinstance(s.xid, int)
    assert (s.namespace, s.pod, s.container) == ("default", "cuda-75454ffb9f-8ljq7", "cuda")
    assert (s.mem_used_mib, s.mem_free_mib) == (1.0, 20015.0)


def test_vgpu_has_no_power_or_temperature():
    (s,) = _parse("k8s-ai-conformance_vks_vGPU-GRID-A100-10C_drv580.126.09.prom")
    assert s.gpu_model == "GRID A100-10C"
    assert (s.power_w, s.temp_c, s.energy_mj, s.xid) == (None, None, None, None)
    assert (s.util_pct, s.mem_free_mib) == (0.0, 9323.0)


def test_old_exporter_with_mig_instance():
    gpu, mig = _parse("nvidia-cloud-native-docs_A100-MIG_dcgm-exporter-2.x.prom")
    assert gpu.gpu_model is None and gpu.mig_profile is None  # 2.x: no modelName label
    assert gpu.power_w == 409.692 and gpu.mem_used_mib == 4845.0 and gpu.xid == 0
    assert gpu.util_pct == pytest.approx(99.563)  # no GPU_UTIL in this page: engine activity in percent
    assert (mig.gpu_uuid, mig.mig_profile, mig.mig_instance) == (gpu.gpu_uuid, "1g.5gb", "13")
    assert mig.util_pct == pytest.approx(99.5687) and mig.power_w is None
    assert gpu.key() != mig.key()


def test_lowercase_labels_blank_sentinel_and_empty_pod_labels():
    text = (
        'DCGM_FI_DEV_GPU_UTIL{gpu="1",uuid="GPU-x",device="nvidia1",hostname="n7",'
        'container="",namespace="",pod=""} 37\n'
        'DCGM_FI_DEV_MEMORY_TEMP{gpu="1",uuid="GPU-x",hostname="n7"} 9223372036854775794\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="1",uuid="GPU-x",hostname="n7"} 9223372036854775794\n'
        'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="1",uuid="GPU-x",hostname="n7"} 2\n'
        'DCGM_FI_DEV_ECC_SBE_AGG_TOTAL{gpu="1",uuid="GPU-x",hostname="n7"} 5\n'
        'DCGM_FI_DEV_XID_ERRORS{gpu="1",uuid="GPU-x",hostname="n7",err_code="79",'
        'err_msg="GPU has fallen off the bus"} 79\n'
    )
    (s,) = parse_metrics(text, cluster="c", ts=TS)
    assert (s.node, s.gpu_uuid, s.gpu_index, s.util_pct) == ("n7", "GPU-x", 1, 37.0)
    assert (s.namespace, s.pod, s.container) == (None, None, None)
    assert s.temp_c is None  # the blank sentinel is "no value", not 9.2e18 degrees
    assert (s.xid, s.ecc_dbe, s.ecc_sbe) == (79, 2, 5)
    assert is_blank(float("nan")) and is_blank(140737488355328.0) and not is_blank(4742776.0)


def test_a_page_without_hostname_is_left_out_with_a_warning_not_an_error(caplog):
    caplog.set_level(logging.WARNING, logger="hybridflow.metering.dcgm")
    assert parse_metrics('DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a"} 3\n', cluster="c", ts=TS, source="p") == []
    (record,) = caplog.records
    assert record.getMessage().startswith("p: 1 GPU(s) (GPU-a) have series without a Hostname/hostname label")


def test_bad_pages_are_refused_with_the_reason():
    with pytest.raises(MalformedMetrics, match="no DCGM_ series"):
        parse_metrics("go_goroutines 12\n", cluster="c", ts=TS, source="http://x/metrics")
    with pytest.raises(MalformedMetrics, match="not Prometheus text format"):
        parse_metrics("<html><body>login</body></html>\n", cluster="c", ts=TS)
    (s,) = parse_metrics('DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a"} 3\n', cluster="c", ts=TS, default_node="n1")
    assert s.node == "n1"
    with pytest.raises(ValueError, match="UTC"):
        parse_metrics("", cluster="c", ts=datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="UTC"):
        parse_metrics("", cluster="c", ts=datetime(2026, 1, 1, tzinfo=timezone(timedelta(hours=2))))


class _Exporter(http.server.BaseHTTPRequestHandler):
    plan: list[tuple[int, str]] = []
    hits = 0

    def do_GET(self):  # noqa: N802
        cls = type(self)
        status, body = cls.plan[min(cls.hits, len(cls.plan) - 1)]
        cls.hits += 1
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def exporter():
    handler = type("Handler", (_Exporter,), {"plan": [], "hits": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield handler, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


FAST = ScrapeSettings(connect_timeout_s=1, read_timeout_s=2, retries=2, backoff_s=0.01)


def test_scrape_retries_server_errors_then_parses(exporter):
    handler, url = exporter
    page = (SAMPLES / "k8s-ai-conformance_kops_aws-L4_drv580.105.08.prom").read_text()
    handler.plan = [(503, "busy"), (200, page)]
    (s,) = scrape(url, cluster="edge", ts=TS, settings=FAST)
    assert handler.hits == 2 and s.cluster == "edge" and s.gpu_model == "NVIDIA L4"


def test_scrape_fails_fast_on_not_found_and_gives_up_on_persistent_5xx(exporter):
    handler, url = exporter
    handler.plan = [(404, "no")]
    with pytest.raises(ExporterUnreachable, match="HTTP 404"):
        fetch(url, FAST)
    assert handler.hits == 1
    handler.plan, handler.hits = [(500, "boom")], 0
    with pytest.raises(ExporterUnreachable, match="server errors after 2 retries"):
        fetch(url, FAST)
    assert handler.hits == 3


def test_unreachable_exporter_names_the_url():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connection refused
        with pytest.raises(ExporterUnreachable, match=f"127.0.0.1:{port}/metrics: no answer"):
            fetch(f"http://127.0.0.1:{port}/metrics", FAST)
    with pytest.raises(DcgmError, match="neither an http"):
        scrape("/nonexistent/metrics.prom", cluster="c", ts=TS)


def test_cli_prints_samples_as_json(exporter, capsys):
    handler, url = exporter
    handler.plan = [(200, (SAMPLES / "lke_RTX4000Ada_k8s-pod-labels_xid-errmsg_drv580.95.05.prom").read_text())]
    assert cli_main(["dcgm", url, "--cluster", "lke"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["cluster"] == "lke" and record["pod"] == "cuda-75454ffb9f-8ljq7" and record["xid"] == 0
    datetime.fromisoformat(record["ts"])
    assert cli_main(["dcgm", str(SAMPLES / "nvidia-cloud-native-docs_A100-MIG_dcgm-exporter-2.x.prom")]) == 0
    assert [r["mig_profile"] for r in json.loads(capsys.readouterr().out)] == [None, "1g.5gb"]
    handler.plan = [(200, "up 1\n")]
    with pytest.raises(SystemExit, match="hybridflow dcgm: .*no DCGM_ series"):
        cli_main(["dcgm", url, "--retries", "0"])


class _Endless(http.server.BaseHTTPRequestHandler):
    """An endpoint that streams a page without a Content-Length (delimited by closing)."""

    chunk = (b'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-x",Hostname="n1",modelName="L4"} 1\n' * 900)
    chunks = 48  # about 3 MiB

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        try:
            for _ in range(self.chunks):
                self.wfile.write(self.chunk)
        except OSError:
            pass  # the reader gave up: that is the point

    def log_message(self, *args):
        pass


def test_a_page_larger_than_the_limit_is_refused_while_reading(exporter):
    import tracemalloc

    small = ScrapeSettings(connect_timeout_s=1, read_timeout_s=5, retries=0, max_body_bytes=2**20)
    handler, url = exporter
    page = "DCGM_FI_DEV_GPU_UTIL 1\n" * 200_000  # about 4.6 MiB, with its Content-Length
    handler.plan = [(200, page)]
    with pytest.raises(MalformedMetrics, match=r"more than metering.max_body_mib \(1 MiB\)"):
        fetch(url, small)
    assert len(fetch(url, FAST)) == len(page)  # within the default 16 MiB it is read whole

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endless)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    tracemalloc.start()
    try:
        with pytest.raises(MalformedMetrics, match=r"passed 1 MiB \(metering.max_body_mib\)"):
            fetch(f"http://127.0.0.1:{server.server_address[1]}/metrics", small)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert peak < 3 * 2**20  # cut off after about 1 MiB, never read whole
