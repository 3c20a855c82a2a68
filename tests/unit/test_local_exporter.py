"""The local stand-in exporter: dcgm-exporter text for a local cluster's slots, from real workers."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import pytest

from hybridflow.backends import local as local_backend
from hybridflow.backends.local import GangJob, LocalGangBackend
from hybridflow.config import Cluster
from hybridflow.errors import GangError
from hybridflow.metering.dcgm import fetch, parse_metrics
from hybridflow.metering.local_exporter import LocalExporterServer, LocalSlotExporter

BURNER = """
import signal, sys, time
block = bytearray(96 * 1024 * 1024)  # resident: touch every page
for i in range(0, len(block), 4096):
    block[i] = 1
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    sum(range(10000))
"""


def _cluster(name="onprem-a", gpus=(2, 1), backend="local") -> Cluster:
    pools = [{"name": f"p{i}", "gpu_model": m, "gpu_memory_gib": 80, "gpus": n}
             for i, (m, n) in enumerate(zip(("A100-80GB", "H100-80GB"), gpus, strict=False))]
    c = Cluster.model_validate({"location": "private", "region": "r", "backend": backend,
                                "node_pools": pools, "prices": {"onprem": 1.0}})
    c._name = name
    return c


def _wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_idle_cluster_reports_every_slot_free():
    exporter = LocalSlotExporter("/nonexistent-state", _cluster(), node="box")
    samples = parse_metrics(exporter.render(), cluster="onprem-a", ts=datetime(2026, 1, 1, tzinfo=UTC))
    assert [(s.gpu_index, s.gpu_model, s.pod, s.util_pct, s.mem_free_mib) for s in samples] == [
        (0, "A100-80GB", None, 0.0, 81920.0), (1, "A100-80GB", None, 0.0, 81920.0),
        (2, "H100-80GB", None, 0.0, 81920.0)]
    assert {s.node for s in samples} == {"box"} and samples[0].power_w == 60.0
    assert samples[0].gpu_uuid == "GPU-local-onprem-a-0"


def test_refuses_kubernetes_clusters_and_bad_power_model():
    with pytest.raises(ValueError, match="local clusters only"):
        LocalSlotExporter("/x", _cluster(backend="kubernetes"))
    with pytest.raises(ValueError, match="idle_w <= busy_w"):
        LocalSlotExporter("/x", _cluster(), idle_w=500, busy_w=100)


def test_running_gang_shows_its_workers_cpu_memory_and_pod(tmp_path, monkeypatch):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "hf_test_burner.py").write_text(BURNER)
    monkeypatch.setattr(local_backend, "WORKER_MODULE", "hf_test_burner")
    cluster = _cluster()
    backend = LocalGangBackend(tmp_path / "state", cluster.name, cluster.total_gpus, grace_s=5)
    job = GangJob(name="train-vision-run-1", workers=2, spec={}, labels={"project": "vision"},
                  env={"PYTHONPATH": str(tmp_path / "mods")})
    outcome: list[object] = []

    def launch():
        try:
            outcome.append(backend.run(job, admission_timeout_s=5, log=lambda line: None))
        except GangError as exc:
            outcome.append(exc)

    launcher = threading.Thread(target=launch)
    launcher.start()
    exporter = LocalSlotExporter(tmp_path / "state", cluster, node="box", idle_w=50, busy_w=300)
    try:
        assert _wait_for(lambda: (backend.job_dir(job.name) / "running.json").exists())
        with LocalExporterServer(exporter) as server:
            ts = datetime(2026, 1, 1, tzinfo=UTC)

            def held():
                return [s for s in parse_metrics(fetch(server.url), cluster=cluster.name, ts=ts) if s.pod]

            assert _wait_for(lambda: all((s.mem_used_mib or 0) >= 96 for s in held()))
            time.sleep(2.0)
            samples = parse_metrics(fetch(server.url), cluster=cluster.name, ts=ts)
    finally:
        backend.cancel(job.name)
        launcher.join(30)
    busy = [s for s in samples if s.pod]
    assert [(s.gpu_index, s.pod, s.namespace, s.container) for s in busy] == [
        (0, "train-vision-run-1", "vision", "rank-0"), (1, "train-vision-run-1", "vision", "rank-1")]
    for s in busy:
        assert s.util_pct >= 2  # a spinning worker, on two CPUs shared with whatever else runs
        assert s.power_w == pytest.approx(50 + 250 * s.util_pct / 100, abs=2.5)
        assert s.mem_free_mib == pytest.approx(81920 - s.mem_used_mib, abs=1)
        assert s.energy_mj > 0
    (idle,) = [s for s in samples if not s.pod]
    assert (idle.gpu_index, idle.gpu_model, idle.util_pct, idle.power_w) == (2, "H100-80GB", 0.0, 50.0)
    assert not launcher.is_alive() and outcome
    # after the gang: every slot free again
    assert not [s for s in parse_metrics(exporter.render(), cluster="c", ts=ts) if s.pod]


def test_only_metrics_path_is_served():
    import requests

    with LocalExporterServer(LocalSlotExporter("/x", _cluster())) as server:
        resp = requests.get(server.url.replace("/metrics", "/"), timeout=5)
        assert resp.status_code == 404


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_cli_serves_a_local_cluster_until_interrupted(tmp_path, stop):
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, HYBRIDFLOW_HOME=str(tmp_path / "home"))
    # Started as from a background shell: SIGINT ignored, which the child inherits.
    proc = subprocess.Popen([sys.executable, "-m", "hybridflow.cli", "local-exporter", "--cluster", "cloud-east",
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert "the local stand-in" in proc.stdout.readline()
        samples = parse_metrics(fetch(f"http://127.0.0.1:{port}/metrics"), cluster="cloud-east",
                                ts=datetime(2026, 1, 1, tzinfo=UTC))
        assert [s.gpu_model for s in samples] == ["H100-80GB"] * 4 + ["A100-80GB"] * 4
    finally:
        proc.send_signal(getattr(signal, stop))
        assert proc.wait(60) == 0
        proc.stdout.close()
    out = subprocess.run([sys.executable, "-m", "hybridflow.cli", "local-exporter", "--cluster", "nowhere"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "'nowhere' is not in clusters.yaml" in out.stderr
