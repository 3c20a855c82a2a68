"""Metrics sources: one interface for everything a cluster's GPU readings can come from, and the one
table that picks an implementation by the name in ``metering.clusters.<cluster>.source``.

- ``exporters``: each node's dcgm-exporter ``/metrics`` page, scraped now;
- ``prometheus``: range queries to a Prometheus that already scrapes the exporters (past windows too);
- ``local``: the local backend's slots through the stand-in exporter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import ClassVar
from urllib.parse import urljoin, urlsplit

from hybridflow.config import Cluster, MeteringCluster, MeteringSettings
from hybridflow.errors import ConfigError
from hybridflow.metering.dcgm import DcgmError, MetricsPage, ScrapeSettings, read_page, read_source
from hybridflow.metering.local_exporter import LocalSlotExporter
from hybridflow.metering.prometheus import PrometheusSource


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A resolved place to read from: URL plus credentials from a Connection (never logged)."""

    url: str
    auth: tuple[str, str] | None = field(default=None, repr=False)


ConnectionLookup = Callable[[str], Endpoint]


@dataclass
class SourceReading:
    """One source's answer for one window: what was read, plus what could not be."""

    page: MetricsPage = field(default_factory=MetricsPage)
    errors: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (host, reason) of exporters that did not answer


def scrape_settings(metering: MeteringSettings, auth: tuple[str, str] | None = None) -> ScrapeSettings:
    return ScrapeSettings(connect_timeout_s=metering.connect_timeout_s, read_timeout_s=metering.read_timeout_s,
                          retries=metering.retries, auth=auth, max_body_bytes=int(metering.max_body_mib * 2**20))


class MetricsSource(ABC):
    """Reads one cluster's GPUs for a window ending at ``window_end``.

    ``reads_past`` says whether a window long gone can still be read; a source that only shows the
    present is not asked for it (the pass is skipped with a reason instead).
    """

    reads_past: ClassVar[bool] = False

    def __init__(self, cluster: Cluster, config: MeteringCluster, metering: MeteringSettings, *,
                 state_dir: Path, lookup: ConnectionLookup | None = None) -> None:
        self.cluster = cluster
        self.config = config
        self.metering = metering
        self.state_dir = state_dir
        self.lookup = lookup

    @abstractmethod
    def read(self, *, window_end: datetime, window: timedelta) -> SourceReading:
        """Samples and Xid counts for the window; unreachable endpoints go to errors, not exceptions."""


class ExporterScrape(MetricsSource):
    """Scrapes every configured dcgm-exporter once; readings are stamped with the window's end."""

    def endpoints(self) -> list[Endpoint]:
        src = self.config
        if src.conn_id is None:
            return [Endpoint(url) for url in src.exporters]
        if self.lookup is None:
            raise DcgmError(f"connection {src.conn_id!r} is configured but no connection lookup was given")
        base = self.lookup(src.conn_id)
        return [Endpoint(urljoin(base.url.rstrip("/") + "/", url), base.auth) for url in src.exporters]

    def read(self, *, window_end: datetime, window: timedelta) -> SourceReading:
        out = SourceReading()
        for endpoint in self.endpoints():
            try:
                text = read_source(endpoint.url, scrape_settings(self.metering, endpoint.auth))
                page = read_page(text, cluster=self.cluster.name, ts=window_end, source=endpoint.url,
                                 default_node=self.config.node)
            except DcgmError as exc:
                out.errors.append(str(exc))
                out.failed.append((urlsplit(endpoint.url).hostname or endpoint.url, str(exc)))
                continue
            out.page.samples += page.samples
            out.page.xid_counts += page.xid_counts
            out.page.warnings += page.warnings
        return out


class PrometheusRange(MetricsSource):
    """Range queries at ``metering.prometheus_step_s`` over (window_end - window, window_end]."""

    reads_past = True

    def read(self, *, window_end: datetime, window: timedelta) -> SourceReading:
        src = self.config
        if src.conn_id is not None and self.lookup is not None:
            endpoint = self.lookup(src.conn_id)
        else:
            endpoint = Endpoint(src.prometheus_url or "")
        step = timedelta(seconds=self.metering.prometheus_step_s)
        prom = PrometheusSource(endpoint.url, selector=src.selector,
                                settings=scrape_settings(self.metering, endpoint.auth))
        # (window_end - window, window_end]: adjacent runs never read the same instant twice
        start = window_end - window + step
        try:
            return SourceReading(prom.read(cluster=self.cluster.name, start=start, end=window_end, step=step))
        except DcgmError as exc:
            return SourceReading(errors=[str(exc)])


class LocalSlots(MetricsSource):
    """The local backend's slots, rendered as an exporter page and read like one."""

    def read(self, *, window_end: datetime, window: timedelta) -> SourceReading:
        exporter = LocalSlotExporter(self.state_dir, self.cluster, node=self.config.node,
                                     idle_w=self.metering.local_idle_w, busy_w=self.metering.local_busy_w)
        return SourceReading(read_page(exporter.render(), cluster=self.cluster.name, ts=window_end,
                                       source=f"local slots of {self.cluster.name}"))


SOURCES: Mapping[str, type[MetricsSource]] = {
    "exporters": ExporterScrape,
    "local": LocalSlots,
    "prometheus": PrometheusRange,
}


def open_source(cluster: Cluster, config: MeteringCluster, metering: MeteringSettings, *, state_dir: Path,
                lookup: ConnectionLookup | None = None) -> MetricsSource:
    """The implementation named by ``config.source``."""
    kind = SOURCES.get(config.source)
    if kind is None:
        raise ConfigError(
            f"metering.clusters.{cluster.name}.source: {config.source!r} is not a metrics source; "
            f"use one of: {', '.join(sorted(SOURCES))}"
        )
    return kind(cluster, config, metering, state_dir=state_dir, lookup=lookup)
