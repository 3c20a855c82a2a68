"""One cluster's metering pass as the DAG runs it: local slots of a running gang, attribution to
its run, the same samples on a re-run, and a cluster whose exporters are all down."""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
import yaml
from tests.support.k8s_config import as_kubernetes

from hybridflow.backends import local as local_backend
from hybridflow.backends.local import GangJob, LocalGangBackend
from hybridflow.errors import GangError
from hybridflow.metering.dcgm import DcgmError
from hybridflow.metering.task import connection_endpoint, meter_cluster
from hybridflow.settings import REPO_ROOT

END = datetime(2026, 5, 1, 12, 5, tzinfo=UTC)
START = END - timedelta(minutes=5)
SPIN = "import time\nwhile True:\n    sum(range(10000))\n"


class Sinks:
    """Keeps what a pass hands to the ledger and node health, keyed like the ledger keys samples."""

    def __init__(self):
        self.samples, self.owners, self.findings = {}, {}, []

    def store(self, samples, owners):
        for s in samples:
            self.samples[s.key()] = s
        self.owners.update(owners)
        return len(samples)

    def report(self, findings):
        self.findings.extend(findings)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(REPO_ROOT / "config"))
    return tmp_path / "home"


def test_a_running_gang_is_metered_and_tied_to_its_run(home, tmp_path, monkeypatch):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "hf_spin_worker.py").write_text(SPIN)
    monkeypatch.setattr(local_backend, "WORKER_MODULE", "hf_spin_worker")
    run_key = "hybrid-training-manual-1-0123456789"
    (home / "private" / "runs" / run_key).mkdir(parents=True)
    backend = LocalGangBackend(home / "state", "onprem-a", 4, grace_s=5)
    job = GangJob(name=f"train-{run_key}", workers=2, spec={}, labels={"project": "vision"},
                  env={"PYTHONPATH": str(tmp_path / "mods")})
    errors = []

    def launch():
        try:
            backend.run(job, admission_timeout_s=5, log=lambda line: None)
        except GangError as exc:
            errors.append(exc)

    launcher = threading.Thread(target=launch)
    launcher.start()
    try:
        deadline = time.monotonic() + 20
        while not (backend.job_dir(job.name) / "running.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sinks = Sinks()
        runs = [meter_cluster("onprem-a", window_start=START, window_end=END, now=END + timedelta(seconds=s),
                              lookup=None, sinks=(sinks.store, sinks.report)) for s in (1, 30)]
    finally:
        backend.cancel(job.name)
        launcher.join(30)
    first, again = runs
    assert first["samples"] == 4 and first["attributed"] == 2 and first["stored"] == 4 and first["errors"] == []
    assert again["samples"] == 4
    assert len(sinks.samples) == 4, "a re-run of the same window stores the same keys, not new ones"
    assert {s.ts for s in sinks.samples.values()} == {END}
    held = sorted((s.gpu_index, s.pod, s.namespace) for s in sinks.samples.values() if s.pod)
    assert held == [(0, job.name, "vision"), (1, job.name, "vision")]
    assert set(sinks.owners.values()) == {run_key} and len(sinks.owners) == 2
    assert [(f.cluster, f.probe_ok, f.xid_codes) for f in sinks.findings] == [("onprem-a", True, ())] * 2


def test_a_cluster_with_every_exporter_down_fails_after_reporting_the_probes(home, tmp_path, monkeypatch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"
        config = tmp_path / "config"
        config.mkdir()
        for name in ("clusters.yaml", "projects.yaml"):
            (config / name).write_text((REPO_ROOT / "config" / name).read_text())
        clusters = yaml.safe_load((config / "clusters.yaml").read_text())
        as_kubernetes(clusters["clusters"]["onprem-a"], conn_id="k8s_a", scheduler="kueue")
        (config / "clusters.yaml").write_text(yaml.safe_dump(clusters))
        pipeline = yaml.safe_load((REPO_ROOT / "config" / "pipeline.yaml").read_text())
        pipeline["metering"].update(retries=0, connect_timeout_s=1,
                                    clusters={"onprem-a": {"source": "exporters", "exporters": [dead]}})
        (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
        monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
        sinks = Sinks()
        with pytest.raises(DcgmError, match="no exporter answered"):
            meter_cluster("onprem-a", window_start=START, window_end=END, now=END, lookup=None,
                          sinks=(sinks.store, sinks.report))
    assert [(f.node, f.probe_ok) for f in sinks.findings] == [("127.0.0.1", False)]
    assert sinks.samples == {}
    with pytest.raises(DcgmError, match="not in clusters.yaml"):
        meter_cluster("nowhere", window_start=START, window_end=END, now=END, lookup=None,
                      sinks=(sinks.store, sinks.report))


def test_stale_window_is_skipped_without_touching_the_sinks(home):
    summary = meter_cluster("onprem-a", window_start=START, window_end=END, now=END + timedelta(days=1),
                            lookup=None, sinks=(None, None))
    assert summary["samples"] == 0 and "only shows the present" in summary["skipped"]


def test_connection_gives_base_url_and_credentials(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_PROM_DC2", json.dumps(
        {"conn_type": "http", "host": "prom.dc2", "port": 9090, "schema": "https", "login": "ops", "password": "pw"}))
    endpoint = connection_endpoint("prom_dc2")
    assert endpoint.url == "https://prom.dc2:9090" and endpoint.auth == ("ops", "pw")
    assert "pw" not in repr(endpoint)
    monkeypatch.setenv("AIRFLOW_CONN_DCGM_NOHOST", json.dumps({"conn_type": "http"}))
    with pytest.raises(DcgmError, match="has no host"):
        connection_endpoint("dcgm_nohost")


