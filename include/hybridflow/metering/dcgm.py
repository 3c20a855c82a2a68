"""dcgm-exporter `/metrics`: scraping over HTTP and parsing into per-GPU samples.

The exporter's label set varies by version and mode (see the reference samples): `UUID` or `uuid`,
`Hostname` or `hostname`, `modelName` only in newer releases, pod labels only in Kubernetes mode and
only on GPUs a pod holds (absent or empty otherwise), MIG series carry `GPU_I_PROFILE`/`GPU_I_ID`,
vGPUs report no power or temperature. Every field a source did not report stays `None`.

Besides per-GPU samples a page gives Xid counts for node health (`DCGM_EXP_XID_ERRORS_COUNT`), and
warnings naming what was seen but could not be metered: GPUs without a node label, GPUs carrying
none of the metered fields. Those are logged and returned, never dropped silently.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from hybridflow.errors import HybridFlowError
from hybridflow.metering.records import GpuSample, XidCount

log = logging.getLogger(__name__)

# DCGM reports "no value" as sentinels near the type's maximum rather than leaving the series out
# (dcgm_structs.h: DCGM_INT64_BLANK = 0x7ffffffffffffff0 and the NOT_FOUND/NOT_SUPPORTED/
# NOT_PERMISSIONED values just above it; DCGM_FP64_BLANK = 2**47 and its neighbours).
_INT64_BLANK = float(0x7FFFFFFFFFFFFFF0)
_FP64_BLANK = 140737488355328.0
_SENTINEL_SPAN = 16.0

_UUID_LABELS = ("UUID", "uuid", "gpu_uuid")
_HOST_LABELS = ("Hostname", "hostname")
_MODEL_LABELS = ("modelName", "model_name")

# metric -> GpuSample field. ECC: volatile totals (since the driver loaded) first, aggregate second.
_FIELDS: Mapping[str, str] = {
    "DCGM_FI_DEV_GPU_UTIL": "util_pct",
    "DCGM_FI_DEV_FB_USED": "mem_used_mib",
    "DCGM_FI_DEV_FB_FREE": "mem_free_mib",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_GPU_TEMP": "temp_c",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "energy_mj",
    "DCGM_FI_DEV_XID_ERRORS": "xid",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "ecc_sbe",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "ecc_dbe",
}
_FALLBACKS: Mapping[str, str] = {
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": "ecc_sbe",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": "ecc_dbe",
    # MIG instances have no DCGM_FI_DEV_GPU_UTIL; the graphics-engine activity ratio is the
    # profiling equivalent (0..1), scaled to percent below.
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "util_pct",
}
_INT_FIELDS = frozenset({"xid", "ecc_sbe", "ecc_dbe"})
# Xid counts per GPU over the exporter's window (label window_size_in_ms): one series per Xid seen,
# labelled `xid`, valued with its count. DCGM_EXP_XID_ERRORS_COUNT is the released name (3.3.5-3.4.0
# on); DCGM_FI_DEV_XID_ERRORS_ACTIVE is the name shown when the count was introduced (PR 239).
XID_COUNT_METRICS = frozenset({"DCGM_EXP_XID_ERRORS_COUNT", "DCGM_FI_DEV_XID_ERRORS_ACTIVE"})


class DcgmError(HybridFlowError):
    """An exporter could not be read or its output is not dcgm-exporter metrics."""


class ExporterUnreachable(DcgmError):
    """The endpoint did not answer (connection refused, DNS, timeout, 5xx after retries)."""


class MalformedMetrics(DcgmError):
    """The endpoint answered with something that is not the Prometheus text format of dcgm-exporter."""


@dataclass(frozen=True, slots=True)
class ScrapeSettings:
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 10.0
    retries: int = 2
    backoff_s: float = 0.5
    headers: Mapping[str, str] = field(default_factory=dict)
    auth: tuple[str, str] | None = None
    # The largest answer read (metering.max_body_mib): an endpoint that sends more is refused while
    # reading, so memory stays a small multiple of this whatever it sends.
    max_body_bytes: int = 16 * 1024 * 1024


def is_blank(value: float) -> bool:
    """True for NaN and the DCGM "blank"/"not supported" sentinels."""
    if math.isnan(value) or math.isinf(value):
        return True
    return value >= _INT64_BLANK - 1 or _FP64_BLANK <= value < _FP64_BLANK + _SENTINEL_SPAN


def http_session(settings: ScrapeSettings) -> requests.Session:
    session = requests.Session()
    retry = Retry(
        total=settings.retries,
        connect=settings.retries,
        read=settings.retries,
        status=settings.retries,
        backoff_factor=settings.backoff_s,
        status_forcelist=(500, 502, 503, 504),
        allowed_methods=frozenset({"GET"}),
        raise_on_status=True,
    )
    adapter = HTTPAdapter(max_retries=retry)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    session.headers.update(settings.headers)
    if settings.auth:
        session.auth = settings.auth
    return session


def read_capped(resp: requests.Response, limit: int, url: str) -> bytes:
    """The response body, refused as soon as it passes ``limit`` bytes (declared or sent)."""
    try:
        declared = int(resp.headers.get("Content-Length") or 0)
    except ValueError:
        declared = 0  # a malformed header: the streamed size still counts
    if declared > limit:
        resp.close()
        raise MalformedMetrics(f"{url}: the answer is {declared} bytes, more than metering.max_body_mib "
                               f"({limit / 2**20:g} MiB); raise it if the page is really that large")
    body = bytearray()
    for chunk in resp.iter_content(chunk_size=65536):
        body += chunk
        if len(body) > limit:
            resp.close()
            raise MalformedMetrics(f"{url}: the answer passed {limit / 2**20:g} MiB (metering.max_body_mib) and was "
                                   "cut off; raise it if the page is really that large")
    return bytes(body)


def fetch(url: str, settings: ScrapeSettings | None = None) -> str:
    """GET an exporter's metrics page; transient failures are retried with backoff."""
    settings = settings or ScrapeSettings()
    with http_session(settings) as session:
        try:
            resp = session.get(url, timeout=(settings.connect_timeout_s, settings.read_timeout_s), stream=True)
        except requests.exceptions.RetryError as exc:
            raise ExporterUnreachable(
                f"{url}: the exporter kept answering with server errors after {settings.retries} "
                f"retries ({exc}); check the dcgm-exporter pod's logs on that node"
            ) from exc
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
            raise ExporterUnreachable(
                f"{url}: no answer within {settings.connect_timeout_s:g}s connect / "
                f"{settings.read_timeout_s:g}s read after {settings.retries} retries ({type(exc).__name__}); "
                "check the URL in metering.clusters and that dcgm-exporter listens there (default port 9400)"
            ) from exc
        except requests.exceptions.RequestException as exc:
            raise ExporterUnreachable(f"{url}: request failed ({exc}); check the URL") from exc
        with resp:
            if resp.status_code != 200:
                raise ExporterUnreachable(
                    f"{url}: HTTP {resp.status_code} {resp.reason}; expected 200 with the metrics page "
                    "(dcgm-exporter serves it at /metrics; check the path and the connection's credentials)"
                )
            body = read_capped(resp, settings.max_body_bytes, url)
    return body.decode(resp.encoding or "utf-8", errors="replace")


def read_source(source: str, settings: ScrapeSettings | None = None) -> str:
    """An http(s) URL is scraped; anything else is read as a file holding a metrics page."""
    if source.startswith(("http://", "https://")):
        return fetch(source, settings)
    path = Path(source)
    if not path.is_file():
        raise DcgmError(f"{source}: neither an http(s) URL nor a readable file; give the exporter's /metrics URL")
    return path.read_text(encoding="utf-8")


def _label(labels: Mapping[str, str], names: Iterable[str]) -> str | None:
    for name in names:
        value = labels.get(name)
        if value:
            return value
    return None


def _index(labels: Mapping[str, str]) -> int | None:
    raw = labels.get("gpu", "")
    return int(raw) if raw.isdecimal() else None


@dataclass
class MetricsPage:
    """What one page (or one Prometheus range) gave: per-GPU samples, Xid counts for node health,
    and warnings about GPUs or series that were seen but could not be metered."""

    samples: list[GpuSample] = field(default_factory=list)
    xid_counts: list[XidCount] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def read_page(text: str, *, cluster: str, ts: datetime, source: str = "<text>",
              default_node: str | None = None) -> MetricsPage:
    """Samples, Xid counts and warnings of one metrics page; `ts` is the scrape time (timezone-aware
    UTC), `default_node` names the node when the exporter runs without a Hostname label."""
    if ts.tzinfo is None or ts.utcoffset() is None or ts.utcoffset().total_seconds() != 0:
        raise ValueError(f"ts={ts!r}: give a timezone-aware UTC datetime (datetime.now(UTC))")
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, IndexError, TypeError) as exc:
        raise MalformedMetrics(
            f"{source}: not Prometheus text format ({exc}); expected dcgm-exporter's /metrics page"
        ) from exc
    builder = SampleBuilder(cluster, source=source, default_node=default_node)
    seen_dcgm = False
    for family in families:
        for sample in family.samples:
            # the parser names counter samples `<family>_total`; dcgm-exporter's names are the family's
            name = family.name if sample.name == f"{family.name}_total" else sample.name
            if name.startswith("DCGM_"):
                seen_dcgm = True
                builder.add(name, sample.labels, float(sample.value), ts)
    if not seen_dcgm:
        raise MalformedMetrics(
            f"{source}: no DCGM_ series in the page; is this a dcgm-exporter endpoint (port 9400, /metrics)?"
        )
    return builder.page()


def parse_metrics(text: str, *, cluster: str, ts: datetime, source: str = "<text>",
                  default_node: str | None = None) -> list[GpuSample]:
    """Per-GPU (and per-MIG-instance) samples of one metrics page, in exporter order (warnings logged)."""
    return read_page(text, cluster=cluster, ts=ts, source=source, default_node=default_node).samples


METERED_METRICS: tuple[str, ...] = (*_FIELDS, *_FALLBACKS)
_LISTED = 6  # GPUs or series named in a warning before "and N more"


def _some(items: Iterable[str]) -> str:
    items = list(items)
    shown = ", ".join(items[:_LISTED])
    return shown + (f" and {len(items) - _LISTED} more" if len(items) > _LISTED else "")


class SampleBuilder:
    """Folds dcgm-exporter series values into one GpuSample per (node, GPU, MIG instance, time),
    collects Xid counts, and remembers what it had to leave out for :meth:`page`'s warnings.

    Shared by the exporter page parser and the Prometheus source, so both read labels alike.
    """

    def __init__(self, cluster: str, *, source: str, default_node: str | None = None) -> None:
        self.cluster = cluster
        self.source = source
        self.default_node = default_node
        self._groups: dict[tuple[str, str, str, str, datetime], dict] = {}
        self._xid_counts: list[XidCount] = []
        self._gpus: dict[str, str] = {}  # "node/uuid" of every GPU seen -> uuid
        self._unmetered: set[str] = set()  # series names seen that metering does not read
        self._nodeless: dict[str, set[str]] = {}  # uuid -> series names without a node label

    def add(self, name: str, labels: Mapping[str, str], value: float, ts: datetime) -> None:
        uuid = _label(labels, _UUID_LABELS)
        if uuid is None:
            return  # NVSwitch, link and CPU series: not a GPU
        node = _label(labels, _HOST_LABELS) or self.default_node
        if node is None:
            self._nodeless.setdefault(uuid, set()).add(name)
            return
        self._gpus.setdefault(f"{node}/{uuid}", uuid)
        if name in XID_COUNT_METRICS:
            self._add_xid_count(labels, value, ts, node, uuid)
            return
        target = _FIELDS.get(name)
        fallback = _FALLBACKS.get(name)
        if target is None and fallback is None:
            self._unmetered.add(name)
            return
        group = self._group(labels, ts, node, uuid)
        if is_blank(value):
            return
        if target is not None:
            group[target] = value
        else:
            if name == "DCGM_FI_PROF_GR_ENGINE_ACTIVE":
                value *= 100.0
            group["_fallback"][fallback] = value

    def _group(self, labels: Mapping[str, str], ts: datetime, node: str, uuid: str) -> dict:
        mig_profile = labels.get("GPU_I_PROFILE") or None
        mig_instance = labels.get("GPU_I_ID") or None
        key = (node, uuid, mig_profile or "", mig_instance or "", ts)
        group = self._groups.setdefault(key, {
            "ts": ts, "cluster": self.cluster, "node": node, "gpu_uuid": uuid,
            "gpu_index": _index(labels), "gpu_model": _label(labels, _MODEL_LABELS),
            "mig_profile": mig_profile, "mig_instance": mig_instance,
            "namespace": None, "pod": None, "container": None, "_fallback": {},
        })
        for k8s_label in ("namespace", "pod", "container"):
            # Prometheus renames an exporter's pod labels to exported_* when its own target labels
            # (the exporter pod's namespace and name) take those names.
            if group[k8s_label] is None:
                group[k8s_label] = _label(labels, (f"exported_{k8s_label}", k8s_label))
        return group

    def _add_xid_count(self, labels: Mapping[str, str], value: float, ts: datetime, node: str, uuid: str) -> None:
        # A GPU without Xids in the window has one series without an `xid` label and value 0.
        raw = labels.get("xid", "")
        if not raw.isdecimal() or int(raw) == 0 or is_blank(value) or value < 1:
            return
        window = labels.get("window_size_in_ms", "")
        self._xid_counts.append(XidCount(
            ts=ts, cluster=self.cluster, node=node, gpu_uuid=uuid, mig_instance=labels.get("GPU_I_ID") or None,
            xid=int(raw), count=int(value), window_ms=int(window) if window.isdecimal() else None))

    def samples(self) -> list[GpuSample]:
        return [_to_sample(dict(group)) for group in self._groups.values()]

    def warnings(self) -> list[str]:
        """What was seen but left out: GPUs without a node label, GPUs with none of the metered fields."""
        out = []
        if self._nodeless:
            names = sorted(set().union(*self._nodeless.values()))
            out.append(
                f"{self.source}: {len(self._nodeless)} GPU(s) ({_some(self._nodeless)}) have series without a "
                f"Hostname/hostname label ({_some(names)}), so they were left out; set the node name "
                "(metering.clusters.<cluster>.node, or --node for hybridflow dcgm) for an exporter run "
                "without one (dcgm-exporter --no-hostname)")
        metered = {f"{key[0]}/{key[1]}" for key in self._groups}
        bare = [gpu for gpu in self._gpus if gpu not in metered]
        if bare:
            seen = _some(sorted(self._unmetered)) if self._unmetered else "only Xid counts"
            out.append(
                f"{self.source}: {len(bare)} GPU(s) ({_some(bare)}) carry none of the fields metering reads "
                f"(expected one of {', '.join(METERED_METRICS)}; seen: {seen}), so no samples were recorded "
                "for them; add those fields to the exporter's collectors file (a renamed field, as in "
                "dcgm-exporter 4.9 and later, is not read)")
        return out

    def page(self) -> MetricsPage:
        """Everything read so far; its warnings are also logged."""
        page = MetricsPage(self.samples(), list(self._xid_counts), self.warnings())
        for warning in page.warnings:
            log.warning("%s", warning)
        return page


def _to_sample(group: dict) -> GpuSample:
    fallback = group.pop("_fallback")
    values = {}
    for name in ("util_pct", "mem_used_mib", "mem_free_mib", "power_w", "temp_c", "energy_mj",
                 "xid", "ecc_sbe", "ecc_dbe"):
        value = group.get(name, fallback.get(name))
        if value is not None and name in _INT_FIELDS:
            value = int(value)
        values[name] = value
    base = {k: v for k, v in group.items() if k not in values}
    return GpuSample(**base, **values)


def scrape(url: str, *, cluster: str, ts: datetime, settings: ScrapeSettings | None = None,
           default_node: str | None = None) -> list[GpuSample]:
    return parse_metrics(read_source(url, settings), cluster=cluster, ts=ts, source=url,
                         default_node=default_node)
