"""The local stand-in for a GPU node's dcgm-exporter.

The local backend runs gang workers as processes on "slots" (one per configured GPU) and has no
GPUs to read. So that the whole metering loop (scrape, ledger, allocation, node health) runs on the
embedded default, this module publishes the dcgm-exporter text format for a local cluster's slots,
derived from the real worker processes:

- utilisation: the worker's CPU use (process and children, percent of one core, capped at 100),
  averaged since the previous render, or since the worker started on the first one;
- memory used: the worker's resident set (process and children); free: the slot's configured GPU
  memory minus that;
- power: a linear model between the configured idle and busy watts by that utilisation;
  energy: the same model integrated over the worker's lifetime (a counter that restarts with it);
- pod = the gang job's name, namespace = the job's project label, container = rank-<n>.

Temperature and ECC are not modelled (left out, as a vGPU leaves them out). Slots are numbered in
admission order at each render (the local pool does not pin gangs to slot numbers), idle slots are
reported with zero use and no pod labels, just as an exporter reports a GPU no pod holds.

It only reads the backend's files (``slots/<cluster>.json``, ``jobs/*/running.json``): it takes no
lock and never changes slot state.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from hybridflow.backends import local as local_backend
from hybridflow.config import Cluster

_MIB = 1024 * 1024

_HELP = {
    "DCGM_FI_DEV_GPU_UTIL": ("gauge", "GPU utilization (in %)."),
    "DCGM_FI_DEV_FB_USED": ("gauge", "Framebuffer memory used (in MiB)."),
    "DCGM_FI_DEV_FB_FREE": ("gauge", "Framebuffer memory free (in MiB)."),
    "DCGM_FI_DEV_POWER_USAGE": ("gauge", "Power draw (in W)."),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("counter", "Total energy consumption since boot (in mJ)."),
    "DCGM_FI_DEV_XID_ERRORS": ("gauge", "Value of the last XID error encountered."),
}


@dataclass(frozen=True, slots=True)
class SlotReading:
    index: int
    gpu_model: str
    memory_mib: float
    job: str | None = None
    project: str | None = None
    rank: int | None = None
    util_pct: float = 0.0
    rss_mib: float = 0.0
    cpu_seconds: float = 0.0
    age_s: float = 0.0


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


class LocalSlotExporter:
    """Renders dcgm-exporter metrics for one local cluster's slots. Keep one instance per
    endpoint: utilisation is averaged between its renders."""

    def __init__(self, state_dir: Path, cluster: Cluster, *, node: str | None = None,
                 idle_w: float = 60.0, busy_w: float = 400.0) -> None:
        if not cluster.on_this_machine:
            raise ValueError(f"cluster {cluster.name!r} has backend {cluster.backend!r}; the stand-in "
                             "exporter is for local clusters only (scrape the real dcgm-exporter there)")
        if not 0 <= idle_w <= busy_w:
            raise ValueError(f"idle_w={idle_w} busy_w={busy_w}: need 0 <= idle_w <= busy_w")
        self.state_dir = Path(state_dir)
        self.cluster = cluster
        self.node = node or f"{socket.gethostname()}-{cluster.name}"
        self.idle_w = idle_w
        self.busy_w = busy_w
        self._last: dict[tuple[int, float], tuple[float, float]] = {}  # (pid, create) -> (wall, cpu)
        self._lock = threading.Lock()

    def _slot_models(self) -> list[tuple[str, float]]:
        return [(p.gpu_model, p.gpu_memory_gib * 1024.0) for p in self.cluster.node_pools for _ in range(p.gpus)]

    def _gangs(self) -> list[tuple[str, dict, dict]]:
        """(job name, slot holding, running record) in admission order."""
        pool = _read_json(self.state_dir / "slots" / f"{self.cluster.name}.json") or {}
        holdings = pool.get("holdings") or {}
        out = []
        for name, holding in sorted(holdings.items(), key=lambda kv: (kv[1].get("since", 0), kv[0])):
            record = _read_json(self.state_dir / "jobs" / name / "running.json") or {}
            if record.get("cluster", self.cluster.name) != self.cluster.name:
                record = {}
            out.append((name, holding, record))
        return out

    def _measure(self, pid: int, now: float) -> tuple[float, float, float, float] | None:
        """(util %, rss MiB, cpu seconds, age s) of a live worker and its children, or None."""
        try:
            proc = psutil.Process(pid)
            if local_backend.WORKER_MODULE not in " ".join(proc.cmdline()):
                return None  # pid reused by something else
            procs = [proc, *proc.children(recursive=True)]
            cpu = rss = 0.0
            for p in procs:
                try:
                    t = p.cpu_times()
                    cpu += t.user + t.system
                    rss += p.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            created = proc.create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None
        key = (pid, created)
        with self._lock:
            last_wall, last_cpu = self._last.get(key, (created, 0.0))
            self._last[key] = (now, cpu)
        span = max(now - last_wall, 1e-6)
        util = min(100.0, max(0.0, 100.0 * (cpu - last_cpu) / span))
        return util, rss / _MIB, cpu, max(0.0, now - created)

    def snapshot(self, now: float | None = None) -> list[SlotReading]:
        now = time.time() if now is None else now
        models = self._slot_models()
        readings: list[SlotReading] = []
        for job, holding, record in self._gangs():
            workers = {int(w["rank"]): int(w["pid"]) for w in record.get("workers", [])}
            project = (record.get("labels") or {}).get("project")
            for rank in range(int(holding.get("slots", 0))):
                if len(readings) >= len(models):
                    break
                model, memory = models[len(readings)]
                measured = self._measure(workers[rank], now) if rank in workers else None
                util, rss, cpu, age = measured or (0.0, 0.0, 0.0, 0.0)
                readings.append(SlotReading(len(readings), model, memory, job, project, rank,
                                            util, rss, cpu, age))
        while len(readings) < len(models):
            model, memory = models[len(readings)]
            readings.append(SlotReading(len(readings), model, memory))
        return readings

    def _power(self, util_pct: float) -> float:
        return self.idle_w + (self.busy_w - self.idle_w) * util_pct / 100.0

    def render(self, now: float | None = None) -> str:
        """The metrics page, in dcgm-exporter's label order and number format."""
        readings = self.snapshot(now)
        lines: list[str] = []
        for metric, (kind, help_text) in _HELP.items():
            lines.append(f"# HELP {metric} {help_text}")
            lines.append(f"# TYPE {metric} {kind}")
            for r in readings:
                if metric == "DCGM_FI_DEV_GPU_UTIL":
                    value = f"{round(r.util_pct)}"
                elif metric == "DCGM_FI_DEV_FB_USED":
                    value = f"{round(r.rss_mib)}"
                elif metric == "DCGM_FI_DEV_FB_FREE":
                    value = f"{max(0, round(r.memory_mib - r.rss_mib))}"
                elif metric == "DCGM_FI_DEV_POWER_USAGE":
                    value = f"{self._power(r.util_pct):.6f}"
                elif metric == "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION":
                    busy_s = min(r.cpu_seconds, r.age_s)
                    joules = self.idle_w * r.age_s + (self.busy_w - self.idle_w) * busy_s
                    value = f"{round(joules * 1000)}"
                else:
                    value = "0"
                lines.append(f"{metric}{{{self._labels(r)}}} {value}")
        return "\n".join(lines) + "\n"

    def _labels(self, r: SlotReading) -> str:
        pairs = [
            ("gpu", str(r.index)),
            ("UUID", f"GPU-local-{self.cluster.name}-{r.index}"),
            ("device", f"nvidia{r.index}"),
            ("modelName", r.gpu_model),
            ("Hostname", self.node),
        ]
        if r.job is not None:
            pairs += [("container", f"rank-{r.rank}"), ("namespace", r.project or ""), ("pod", r.job)]
        return ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class LocalExporterServer:
    """Serves ``/metrics`` of a :class:`LocalSlotExporter` on a loopback port, in a thread."""

    def __init__(self, exporter: LocalSlotExporter, host: str = "127.0.0.1", port: int = 0) -> None:
        exporter_ref = exporter

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = exporter_ref.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name=f"local-exporter-{exporter.cluster.name}")

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/metrics"

    def start(self) -> LocalExporterServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> LocalExporterServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
