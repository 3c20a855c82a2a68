"""Serving test helpers: both example models (digits: 64 int columns, class output; breast-cancer: 30
float columns, probability output) as bundles of several versions and variants, JSON calls to a
server or the gateway, and model processes started and stopped by pid.

Import ``assets`` (a module-scoped fixture) from here."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tests.support import bundles

from hybridflow.bundle import write_bundle

# The served digits bundle declares its pixels as the dataset holds them: whole numbers 0..16.
INT_DIGITS = {"inputs": [{"name": "pixel_{0..63}", "type": "int", "min": 0, "max": 16}],
              "output": {"name": "digit", "type": "class", "classes": 10}}
MODELS = {"digits": "digits-mlp", "breast-cancer": "breast-cancer"}  # endpoint -> registered model


def http_call(method: str, url: str, body=None, raw: bytes | None = None, timeout: float = 10.0):
    """(status, JSON body, headers); header names match in any case, as in HTTP."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def predict_url(base: str, endpoint: str) -> str:
    return f"{base}/v1/models/{endpoint}:predict"


def start_module(args: list[str], log: Path, python: str | None = None) -> subprocess.Popen:
    """``python -m args...`` (this interpreter unless named), its output appended to ``log``."""
    with open(log, "ab") as fh:
        return subprocess.Popen([python or sys.executable, "-m", *args], stdout=fh, stderr=subprocess.STDOUT)


def start_servers(specs: list[tuple[Path, str, str, list[str]]], folder: Path, *, script: Path | None = None,
                  wait_s: float = 120) -> list[tuple[subprocess.Popen, str]]:
    """Model servers (``python -m hybridflow.serving.server``, or ``script`` taking the same flags), one per
    (bundle, endpoint, version, extra flags), started together in their own environment on free ports of
    127.0.0.1 -> [(process, base URL)] once each listens."""
    from hybridflow.serving.runtime import serve_python

    started = []
    for bundle_dir, endpoint, version, flags in specs:
        ready, log = folder / f"{endpoint}-{version}.ready", folder / f"{endpoint}-{version}.log"
        args = ["--bundle", str(bundle_dir), "--endpoint", endpoint, "--version", version, "--port", "0",
                "--host", "127.0.0.1", "--ready-file", str(ready), *flags]
        command = [serve_python(), str(script)] if script else [serve_python(), "-m", "hybridflow.serving.server"]
        with open(log, "ab") as fh:
            started.append((subprocess.Popen([*command, *args], stdout=fh, stderr=subprocess.STDOUT), ready, log))
    deadline = time.monotonic() + wait_s
    servers = []
    try:
        for (proc, ready, log), (_, endpoint, version, _) in zip(started, specs, strict=True):
            while not ready.is_file():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"{endpoint} {version} server did not start: {log.read_text()[-3000:]}")
                time.sleep(0.05)
            info = json.loads(ready.read_text())
            assert info["pid"] == proc.pid and (info["endpoint"], info["version"]) == (endpoint, version)
            servers.append((proc, f"http://127.0.0.1:{info['port']}"))
    except BaseException:
        for proc, _, _ in started:
            stop_process(proc)
        raise
    return servers


def start_server(bundle_dir: Path, endpoint: str, version: str, folder: Path, *flags: str,
                 script: Path | None = None, wait_s: float = 120) -> tuple[subprocess.Popen, str]:
    """One model server (see :func:`start_servers`) -> (process, base URL)."""
    return start_servers([(bundle_dir, endpoint, version, list(flags))], folder, script=script, wait_s=wait_s)[0]


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Both example models trained briefly, as bundles of several versions and variants."""
    root = tmp_path_factory.mktemp("serving")
    digits = bundles.seed("digits-mlp", root / "digits-data")
    cancer = bundles.seed("breast-cancer", root / "cancer-data")
    digits_module = bundles.train("digits-mlp", digits)
    cancer_module = bundles.train("breast-cancer", cancer)
    make = bundles.make_bundle
    garbage = write_bundle(root / "digits-garbage", b"this is not a state dict" * 10,
                           bundles.card("digits-mlp", version="v4", signature=INT_DIGITS))
    return {
        "data": {"digits": digits, "breast-cancer": cancer},
        "digits": {
            "v1": make(root / "digits-v1", "digits-mlp", digits_module, version="v1", signature=INT_DIGITS),
            "v2": make(root / "digits-v2", "digits-mlp", digits_module, variant="int8", version="v2",
                       signature=INT_DIGITS),
            "untrained": make(root / "digits-untrained", "digits-mlp", bundles.train("digits-mlp", digits, steps=0),
                              version="v3", signature=INT_DIGITS),
            "garbage": garbage,
        },
        "breast-cancer": {
            "b1": make(root / "cancer-b1", "breast-cancer", cancer_module, variant="fp16", version="b1"),
            # Untrained, its roc_auc on the held-out split is below the registered gate of 0.95.
            "untrained": make(root / "cancer-untrained", "breast-cancer",
                              bundles.train("breast-cancer", cancer, steps=0), version="b0"),
        },
    }


def smoke_data(assets, endpoint: str, rows: int = 200):
    return assets["data"][endpoint].xy("test", rows)


def gate_metric(endpoint: str) -> dict:
    return bundles.entry(MODELS[endpoint]).metric.model_dump(mode="json")
