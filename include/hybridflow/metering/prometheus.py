"""Per-GPU samples from a Prometheus server that already scrapes dcgm-exporter.

Range queries (``/api/v1/query_range``) at a fixed step give every metered metric at the same
evaluation instants, so the values of one GPU at one instant fold into one :class:`GpuSample`,
exactly as a direct scrape would. The dcgm-exporter scrape job should keep the exporter's own pod
labels (``honor_labels: true``, the dcgm-exporter chart's default); where Prometheus renamed them to
``exported_pod``/``exported_namespace``/``exported_container`` those are used.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import requests

from hybridflow.metering.dcgm import (
    METERED_METRICS,
    XID_COUNT_METRICS,
    DcgmError,
    ExporterUnreachable,
    MalformedMetrics,
    MetricsPage,
    SampleBuilder,
    ScrapeSettings,
    http_session,
    read_capped,
)
from hybridflow.metering.records import GpuSample

log = logging.getLogger(__name__)

# Prometheus refuses range queries of more than 11,000 points per series.
MAX_POINTS = 11_000
QUERIED_METRICS: tuple[str, ...] = (*METERED_METRICS, *sorted(XID_COUNT_METRICS))


def aligned_window(end: datetime, span: timedelta, step: timedelta) -> tuple[datetime, datetime]:
    """[start, end] snapped to multiples of ``step``: a re-run over the same period asks for the
    same instants, so the same readings get the same keys."""
    step_s = step.total_seconds()
    end_s = math.floor(end.timestamp() / step_s) * step_s
    start_s = end_s - math.floor(span.total_seconds() / step_s) * step_s
    return datetime.fromtimestamp(start_s, UTC), datetime.fromtimestamp(end_s, UTC)


class PrometheusSource:
    """Reads dcgm-exporter series of one cluster from Prometheus' HTTP API.

    ``selector`` is a label matcher list without braces (e.g. ``cluster="onprem-a"``) that picks the
    cluster's exporters when one Prometheus watches several clusters.
    """

    def __init__(self, base_url: str, *, selector: str = "", settings: ScrapeSettings | None = None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise DcgmError(f"prometheus url {base_url!r}: give http(s)://host:9090")
        self.base_url = base_url.rstrip("/")
        self.selector = selector.strip().strip("{}")
        self.settings = settings or ScrapeSettings()

    def _query(self, session: requests.Session, query: str, start: float, end: float, step: float) -> list[dict]:
        url = f"{self.base_url}/api/v1/query_range"
        params = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        try:
            resp = session.get(url, params=params, stream=True,
                               timeout=(self.settings.connect_timeout_s, self.settings.read_timeout_s))
        except requests.exceptions.RequestException as exc:
            raise ExporterUnreachable(
                f"{url}: Prometheus did not answer after {self.settings.retries} retries "
                f"({type(exc).__name__}); check metering.clusters.<name>.prometheus and the connection"
            ) from exc
        with resp:
            raw = read_capped(resp, self.settings.max_body_bytes, url)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise MalformedMetrics(
                f"{url}: HTTP {resp.status_code}, not a Prometheus API answer (no JSON); is this Prometheus' base URL?"
            ) from exc
        if resp.status_code != 200 or body.get("status") != "success":
            raise DcgmError(
                f"{url}: query {query!r} failed: HTTP {resp.status_code} "
                f"{body.get('errorType', '')}: {body.get('error', body)}; check the selector"
            )
        data = body.get("data") or {}
        if data.get("resultType") != "matrix":
            raise MalformedMetrics(f"{url}: expected a matrix for a range query, got {data.get('resultType')!r}")
        return data.get("result") or []

    def _chunks(self, start: float, end: float, step: float) -> Iterator[tuple[float, float]]:
        width = step * (MAX_POINTS - 1)
        lo = start
        while lo <= end:
            hi = min(end, lo + width)
            yield lo, hi
            lo = hi + step

    def read(self, *, cluster: str, start: datetime, end: datetime, step: timedelta) -> MetricsPage:
        """Samples of every GPU at each step in [start, end] (ordered by time, node and GPU), the
        exporters' Xid counts at those steps, and a warning when no series matched at all."""
        for name, value in (("start", start), ("end", end)):
            if value.tzinfo is None:
                raise ValueError(f"{name}={value!r}: give a timezone-aware UTC datetime")
        step_s = step.total_seconds()
        if step_s <= 0 or end < start:
            raise ValueError(f"need step > 0 and start <= end, got step={step}, start={start}, end={end}")
        builder = SampleBuilder(cluster, source=self.base_url)
        matcher = f"{{{self.selector}}}" if self.selector else ""
        matched = 0
        with http_session(self.settings) as session:
            for metric in QUERIED_METRICS:
                for lo, hi in self._chunks(start.timestamp(), end.timestamp(), step_s):
                    for series in self._query(session, f"{metric}{matcher}", lo, hi, step_s):
                        matched += 1
                        labels = series.get("metric") or {}
                        for ts, raw in series.get("values") or []:
                            when = datetime.fromtimestamp(float(ts), UTC)
                            builder.add(metric, labels, float(raw), when)
        page = builder.page()
        page.samples.sort(key=lambda s: (s.ts, s.node, s.gpu_index or 0, s.gpu_uuid, s.mig_instance or ""))
        if not matched:
            warning = (f"{self.base_url}: no dcgm-exporter series matched {{{self.selector}}} from "
                       f"{start.isoformat()} to {end.isoformat()}; check metering.clusters.<cluster>.selector "
                       "and that this Prometheus scrapes the cluster's exporters")
            log.warning("%s", warning)
            page.warnings.append(warning)
        return page

    def samples(self, *, cluster: str, start: datetime, end: datetime, step: timedelta) -> list[GpuSample]:
        """Samples of every GPU at each step in [start, end], ordered by time then node and GPU."""
        return self.read(cluster=cluster, start=start, end=end, step=step).samples
