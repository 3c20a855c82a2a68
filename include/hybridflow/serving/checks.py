"""What the local deploy target checks before traffic moves: arguments, readiness, health, the smoke
test (the model's metric on what the new server answers, against its gate); the gate's load tests
are :mod:`hybridflow.serving.rollout`'s."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.errors import DeploymentError
from hybridflow.serving.processes import read_json, tail
from hybridflow.serving.router import ENDPOINT_RE, MODELS_PREFIX
from hybridflow.serving.schema import MAX_INSTANCES, BadRequest, InputSchema

HOST = "127.0.0.1"
SMOKE_BATCH = MAX_INSTANCES  # the server's per-request limit
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class StepFailed(Exception):
    """A deployment step failed; the message says which and why."""


def http_json(method: str, url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) for any HTTP answer; OSError when nothing answers."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = {}
    return status, parsed if isinstance(parsed, dict) else {}


def check_version(version: str) -> None:
    if not isinstance(version, str) or not _VERSION.match(version):
        raise ValueError(f"version={version!r}: use 1-64 letters, numbers, '.', '_' or '-' "
                         "(it names files under the state root)")


def check_endpoint(endpoint: str) -> None:
    if not isinstance(endpoint, str) or not ENDPOINT_RE.match(endpoint):
        raise ValueError(f"endpoint={endpoint!r}: use 1-63 lowercase letters, numbers or '-' "
                         "(it is a URL path segment and a folder under the state root)")


def url_of(port: int) -> str:
    return f"http://{HOST}:{port}"


def model_url(base: str, endpoint: str) -> str:
    return f"{base}{MODELS_PREFIX}{endpoint}"


class DeployPlan:
    """What a deployment needs, checked before anything is started."""

    def __init__(self, bundle_dir: Path, version: str, endpoint: str, port: int,
                 smoke: tuple[np.ndarray, np.ndarray], metric: Mapping[str, Any]) -> None:
        from hybridflow import bundle, scoring
        from hybridflow.config.registry import METRICS, MetricSpec

        check_version(version)
        check_endpoint(endpoint)
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"port={port!r}; use a TCP port 1..65535")
        self.version = version
        self.bundle_dir = Path(bundle_dir).resolve()
        try:
            self.card = bundle.read_card(self.bundle_dir)
        except (FileNotFoundError, ValueError) as exc:
            raise DeploymentError(f"{exc}; nothing was deployed") from exc
        if not (self.bundle_dir / bundle.WEIGHTS_FILE).is_file():
            raise DeploymentError(f"{self.bundle_dir} has no {bundle.WEIGHTS_FILE}; nothing was deployed")
        if self.card.variant not in bundle.VARIANTS:
            raise DeploymentError(f"{self.bundle_dir}: variant {self.card.variant!r} is not one of "
                                  f"{', '.join(bundle.VARIANTS)}; nothing was deployed")
        try:
            self.schema = InputSchema(self.card.signature)
        except ValueError as exc:
            raise DeploymentError(f"{self.bundle_dir}: the card's signature is invalid: {exc}") from exc
        self.output = self.card.output

        if not isinstance(metric, Mapping):
            raise ValueError(f"metric={metric!r}; pass the model's metric spec {{name, gate, ...}} (models.yaml)")
        self.metric = MetricSpec.model_validate(dict(metric))
        if self.output["type"] not in METRICS[self.metric.name][1]:
            raise ValueError(f"metric {self.metric.name} cannot score the {self.output['type']} output of "
                             f"{self.card.model}; use the model's registered metric")

        x, y = np.asarray(smoke[0]), np.asarray(smoke[1])
        width = self.schema.width
        if x.ndim != 2 or x.shape[1] != width or len(x) == 0 or y.shape != (len(x),):
            raise ValueError(f"smoke must be (inputs [n, {width}] in {self.card.model}'s signature order, "
                             f"targets [n]) with n >= 1; got {list(x.shape)} and {list(y.shape)}")
        if not np.issubdtype(x.dtype, np.number) and x.dtype != np.bool_:
            raise ValueError(f"smoke inputs must be numbers, got dtype {x.dtype}")
        self.rows = self.schema.instances(x)
        try:  # the smoke rows must be requests the new server accepts
            for start in range(0, len(self.rows), SMOKE_BATCH):
                self.schema.parse({"instances": self.rows[start:start + SMOKE_BATCH]})
        except BadRequest as exc:
            raise ValueError(f"smoke inputs do not fit {self.card.model}'s signature: {exc}") from exc
        self.targets = y
        try:  # targets the metric cannot score (e.g. one class for roc_auc) fail here, not after a start
            scoring.metric_value(self.metric.name, y, self._as_predictions(y), self.output)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"smoke targets cannot be scored with {self.metric.name}: {exc}") from exc

    def _as_predictions(self, values: Any) -> np.ndarray:
        return np.asarray(values, dtype=np.int64 if self.output["type"] == "class" else np.float64)

    def score(self, predictions: list[Any]) -> float:
        from hybridflow import scoring

        value = scoring.metric_value(self.metric.name, self.targets, self._as_predictions(predictions), self.output)
        return round(float(value), 6)


def wait_ready(proc: subprocess.Popen, ready: Path, log_path: Path, since: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise StepFailed(f"the server exited with code {code} before serving; log tail:\n{tail(log_path, since)}")
        info = read_json(ready)
        if info and info.get("pid") == proc.pid and isinstance(info.get("port"), int):
            return info["port"]
        time.sleep(0.1)
    raise StepFailed(f"the server did not start serving within {timeout:.0f}s; log tail:\n{tail(log_path, since)}")


def wait_healthy(url: str, endpoint: str, version: str, pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status, body = http_json("GET", f"{url}/healthz", timeout=2.0)
            if status == 200 and (body.get("endpoint"), body.get("version"), body.get("pid")) == \
                    (endpoint, version, pid):
                return
            last = f"HTTP {status} {body}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise StepFailed(f"{url}/healthz did not report {endpoint} version {version} within {timeout:.0f}s (last: {last})")


def predict(base: str, endpoint: str, rows: list[list[Any]], version: str) -> list[Any]:
    url = f"{model_url(base, endpoint)}:predict"
    out: list[Any] = []
    for start in range(0, len(rows), SMOKE_BATCH):
        status, body = http_json("POST", url, {"instances": rows[start:start + SMOKE_BATCH]}, timeout=30.0)
        if status != 200:
            raise StepFailed(f"POST {url} answered HTTP {status}: {body.get('error', body)}")
        if body.get("version") != version:
            raise StepFailed(f"POST {url} answered from version {body.get('version')!r}, not {version!r}")
        out.extend(body["predictions"])
    return out


def backend_healthy(active: dict[str, Any], endpoint: str) -> bool:
    try:
        status, body = http_json("GET", f"{active['url']}/healthz", timeout=2.0)
    except (OSError, KeyError, TypeError):
        return False
    return status == 200 and (body.get("endpoint"), body.get("version"), body.get("pid")) == \
        (endpoint, active.get("version"), active.get("pid"))

