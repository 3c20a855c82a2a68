"""Xid counts of newer dcgm-exporters as node-health findings, and pages metering cannot use (no
metered field, no Hostname label) reported with what was seen instead of returned silently empty."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest
from tests.reference import DCGM_SAMPLES

from hybridflow.metering.collect import node_findings
from hybridflow.metering.dcgm import read_page

WRITTEN = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm-exporter-written"
TS = datetime(2026, 5, 1, 12, 5, tzinfo=UTC)
H100_0 = "GPU-5f0c6a3e-1d2b-4c7a-9e11-0a6b2c3d4e50"


def _page(name: str, **kw):
    return read_page((WRITTEN / name).read_text(), cluster="c1", ts=TS, source=name, **kw)


def test_xid_count_series_become_xid_findings_next_to_the_last_xid(caplog):
    caplog.set_level(logging.WARNING)
    page = _page("h100x2_xid-count_window-5min.prom")
    assert page.warnings == [] and caplog.records == []
    assert [(s.gpu_index, s.xid, s.util_pct, s.mem_used_mib) for s in page.samples] == [(0, 79, 0.0, 0.0),
                                                                                       (1, 0, 97.0, 78992.0)]
    # one series per Xid seen in the window; the GPU without Xids has one zero series without `xid`
    assert [(c.node, c.gpu_uuid, c.xid, c.count, c.window_ms, c.ts) for c in page.xid_counts] == [
        ("gpu-node-7", H100_0, 13, 1, 300000, TS), ("gpu-node-7", H100_0, 79, 2, 300000, TS)]
    (finding,) = node_findings(page.samples, xid_counts=page.xid_counts)
    assert (finding.node, finding.xid_codes, finding.probe_ok) == ("gpu-node-7", (13, 79), True)
    assert finding.detail == f"Xid 13 x1 on {H100_0} within 300 s; Xid 79 x2 on {H100_0} within 300 s"


def test_the_count_under_its_early_name_is_read_alike():
    page = _page("t400_xid-errors-active.prom")
    (sample,) = page.samples
    assert (sample.node, sample.util_pct, sample.mem_used_mib, sample.xid) == ("workstation", 12.0, 311.0, None)
    (count,) = page.xid_counts
    assert (count.xid, count.count, count.window_ms) == (42, 1, 300000)
    assert [f.xid_codes for f in node_findings(page.samples, xid_counts=page.xid_counts)] == [(42,)]


def test_a_count_alone_makes_a_finding_and_zero_or_absent_xids_do_not():
    text = (
        '# TYPE DCGM_EXP_XID_ERRORS_COUNT gauge\n'
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="0",UUID="GPU-a",Hostname="n1",window_size_in_ms="60000",xid="94"} 3\n'
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="1",UUID="GPU-b",Hostname="n2",window_size_in_ms="60000",xid="31"} 0\n'
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="2",UUID="GPU-c",Hostname="n2",window_size_in_ms="60000",xid="0"} 4\n'
        'DCGM_EXP_XID_ERRORS_COUNT{gpu="3",UUID="GPU-d",Hostname="n2",window_size_in_ms="60000"} 0\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-b",Hostname="n2"} 5\n'
    )
    page = read_page(text, cluster="c", ts=TS)
    assert [(c.node, c.xid, c.count) for c in page.xid_counts] == [("n1", 94, 3)]
    n1, n2 = node_findings(page.samples, xid_counts=page.xid_counts)
    assert (n1.node, n1.xid_codes, n1.detail) == ("n1", (94,), "Xid 94 x3 on GPU-a within 60 s")
    assert (n2.node, n2.xid_codes, n2.detail) == ("n2", (), "")
    # GPUs with nothing but Xid counts are named: they give findings but no samples
    (warning,) = page.warnings
    assert "3 GPU(s) (n1/GPU-a, n2/GPU-c, n2/GPU-d) carry none of the fields metering reads" in warning


def test_counts_of_a_pass_add_up_over_its_readings():
    page = _page("h100x2_xid-count_window-5min.prom")
    later = read_page((WRITTEN / "h100x2_xid-count_window-5min.prom").read_text()
                      .replace('xid="13"} 1', 'xid="13"} 4'), cluster="c1", ts=TS.replace(minute=6))
    (finding,) = node_findings(page.samples + later.samples, xid_counts=page.xid_counts + later.xid_counts)
    assert finding.xid_codes == (13, 79) and "Xid 13 x4" in finding.detail  # the highest count of the pass


def test_a_page_without_metered_fields_is_reported_with_the_gpus_and_fields(caplog):
    caplog.set_level(logging.WARNING, logger="hybridflow.metering.dcgm")
    page = _page("l40s_clocks-and-pcie-only.prom")
    assert page.samples == [] and page.xid_counts == []
    (warning,) = page.warnings
    assert warning.startswith("l40s_clocks-and-pcie-only.prom: 2 GPU(s) (edge-3/GPU-7a1e2b3c-4d5e-6f70-8192-a3b4c5d6e7f0, "
                              "edge-3/GPU-7a1e2b3c-4d5e-6f70-8192-a3b4c5d6e7f1) carry none of the fields metering reads")
    assert "DCGM_FI_DEV_GPU_UTIL" in warning and "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" in warning
    assert "seen: DCGM_FI_DEV_MEM_CLOCK, DCGM_FI_DEV_PCIE_REPLAY_COUNTER, DCGM_FI_DEV_SM_CLOCK" in warning
    assert [r.getMessage() for r in caplog.records] == [warning] and caplog.records[0].levelname == "WARNING"


def test_a_page_without_hostname_is_reported_whatever_it_holds(caplog):
    caplog.set_level(logging.WARNING, logger="hybridflow.metering.dcgm")
    page = _page("a100x2_no-hostname.prom")
    assert page.samples == [] and page.xid_counts == []
    (warning,) = page.warnings
    assert "2 GPU(s) (GPU-0d7e4a11-6c2f-4b8e-a1d3-93f0c2b4e600, GPU-0d7e4a11-6c2f-4b8e-a1d3-93f0c2b4e601)" in warning
    assert "without a Hostname/hostname label (DCGM_EXP_XID_ERRORS_COUNT, DCGM_FI_DEV_GPU_UTIL, DCGM_FI_DEV_SM_CLOCK)" in warning
    assert "metering.clusters.<cluster>.node" in warning
    assert [r.getMessage() for r in caplog.records] == [warning]
    # the same page with only series metering does not read is reported the same way
    clocks = "\n".join(line for line in (WRITTEN / "a100x2_no-hostname.prom").read_text().splitlines()
                       if "SM_CLOCK" in line) + "\n"
    caplog.clear()
    bare = read_page(clocks, cluster="c1", ts=TS)
    assert bare.samples == [] and "without a Hostname/hostname label (DCGM_FI_DEV_SM_CLOCK)" in bare.warnings[0]
    assert len(caplog.records) == 1
    # with the node named in the configuration everything is read, Xid counts included
    named = _page("a100x2_no-hostname.prom", default_node="a100-box")
    assert named.warnings == [] and [s.util_pct for s in named.samples] == [64.0, 0.0]
    assert [(f.node, f.xid_codes) for f in node_findings(named.samples, xid_counts=named.xid_counts)] == [
        ("a100-box", (48,))]


@pytest.mark.parametrize("name", sorted(p.name for p in DCGM_SAMPLES.glob("*.prom")))
def test_real_pages_read_without_warnings(name, caplog):
    caplog.set_level(logging.WARNING)
    page = read_page((DCGM_SAMPLES / name).read_text(), cluster="c1", ts=TS, source=name)
    assert page.samples and page.warnings == [] and page.xid_counts == [] and caplog.records == []


def test_long_lists_are_cut_in_warnings():
    lines = [f'DCGM_FI_DEV_SM_CLOCK{{gpu="{i}",UUID="GPU-{i:02d}",Hostname="n"}} 1' for i in range(10)]
    (warning,) = read_page("\n".join(lines) + "\n", cluster="c", ts=TS).warnings
    assert "10 GPU(s) (n/GPU-00, n/GPU-01, n/GPU-02, n/GPU-03, n/GPU-04, n/GPU-05 and 4 more)" in warning
