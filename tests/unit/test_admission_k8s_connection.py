"""Admission probes the Connection of every Kubernetes cluster a run may use: a missing Connection, an
unreadable kubeconfig, a closed port, a silent server and refused credentials are named with the
cluster, the Connection and the fix. The run is refused when no cluster it may use is left, and
warned about otherwise. The real kubernetes client, built by the provider's hook, does the talking."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from tests.support.k8s_config import as_kubernetes, kubeconfig, kubernetes_connection

from hybridflow.admission import admit
from hybridflow.config import Estate, load_estate
from hybridflow.errors import AdmissionError
from hybridflow.settings import REPO_ROOT

CLUSTER, CONN, ENV = "k8s-dc2", "k8s_dc2", "AIRFLOW_CONN_K8S_DC2"
GOOD, READ_ONLY, STALE = "good-token-7f3a9c", "read-only-token-51be", "stale-token-90d2e4"
ONLY_K8S = {"model": "breast-cancer"}  # restricted data: private clusters only, and k8s-dc2 is the private one
SPOT = {"interruptible": True, "spot_allowed": True}  # cloud-east's A100 spot pool may take it too
LISTS = {"/apis/batch.volcano.sh/v1alpha1/namespaces/hybridflow/jobs": "batch.volcano.sh/v1alpha1",
         "/apis/batch/v1/namespaces/hybridflow/jobs": "batch/v1"}


class _ApiServer(BaseHTTPRequestHandler):
    """The two gang-job lists of namespace hybridflow; 401 for an unknown token, 403 for the read-only one."""

    seen: list[tuple[str, str]]

    def do_GET(self) -> None:  # noqa: N802 - the http.server hook's name
        path, _, query = self.path.partition("?")
        auth = self.headers.get("Authorization", "")
        self.seen.append((self.path, auth))
        if auth != f"Bearer {GOOD}":
            code = 403 if auth == f"Bearer {READ_ONLY}" else 401
            body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code}
        elif path in LISTS and query == "limit=1":
            code, body = 200, {"kind": "JobList", "apiVersion": LISTS[path], "metadata": {}, "items": []}
        else:
            code, body = 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def api_server() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(URL, requests seen as (path, Authorization)) of a small API server on loopback."""
    seen: list[tuple[str, str]] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_ApiServer,), {"seen": seen}))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(autouse=True)
def _own_client_defaults(monkeypatch) -> None:
    """The kubeconfig loader sets the client's process-wide default configuration: keep it to this test."""
    from kubernetes.client import Configuration

    monkeypatch.setattr(Configuration, "_default", None)
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture
def private_root(seeded_private: Path, tmp_path: Path) -> Path:
    root = tmp_path / "private"
    shutil.copytree(seeded_private, root)
    return root


def _estate(tmp_path: Path, scheduler: str = "volcano", read_timeout_s: float | None = None) -> Estate:
    """The shipped config with k8s-dc2, a private Kubernetes cluster, in place of onprem-a."""
    config = tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", config)
    clusters = yaml.safe_load((config / "clusters.yaml").read_text())
    clusters["clusters"][CLUSTER] = as_kubernetes(clusters["clusters"].pop("onprem-a"), conn_id=CONN,
                                                  scheduler=scheduler)
    (config / "clusters.yaml").write_text(yaml.safe_dump(clusters, sort_keys=False))
    if read_timeout_s is not None:
        pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
        pipeline["placement"]["cluster_read_timeout_s"] = read_timeout_s
        (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return load_estate(config, use_cache=False)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _refused(estate: Estate, private_root: Path, params: dict) -> str:
    with pytest.raises(AdmissionError) as err:
        admit(params, estate, private_root)
    assert err.value.field == f"clusters.{CLUSTER}.conn_id"
    message = str(err.value)
    assert f"cluster {CLUSTER} (Connection {CONN})" in message
    return message


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_a_cluster_whose_api_server_answers_is_admitted(tmp_path, private_root, monkeypatch, api_server,
                                                        scheduler) -> None:
    url, seen = api_server
    monkeypatch.setenv(ENV, kubernetes_connection(kubeconfig(url, GOOD)))
    run = admit(ONLY_K8S, _estate(tmp_path, scheduler), private_root)
    assert run.must_stay_private
    list_path = next(p for p, v in LISTS.items() if v == ("batch/v1" if scheduler == "kueue" else
                                                            "batch.volcano.sh/v1alpha1"))
    assert seen == [(f"{list_path}?limit=1", f"Bearer {GOOD}")]  # one authenticated request


def test_a_missing_connection_refuses_the_run_naming_the_connection_and_the_fix(tmp_path, private_root) -> None:
    message = _refused(_estate(tmp_path), private_root, ONLY_K8S)
    assert "the Connection does not exist" in message
    assert f"create Airflow Connection {CONN} of type kubernetes" in message and ENV in message
    assert f"clusters.{CLUSTER}.conn_id" in message


@pytest.mark.parametrize(("kube_config", "said"), [
    ("{clusters: [{name: dc2", "at line 1, column"),  # not YAML
    ({"apiVersion": "v1", "clusters": []}, "Expected key current-context"),  # YAML, not a kubeconfig
], ids=["not-yaml", "not-a-kubeconfig"])
def test_a_malformed_kubeconfig_refuses_the_run_with_the_parser_s_message(tmp_path, private_root, monkeypatch,
                                                                          kube_config, said) -> None:
    monkeypatch.setenv(ENV, kubernetes_connection(kube_config))
    message = _refused(_estate(tmp_path), private_root, ONLY_K8S)
    assert "kubeconfig unreadable" in message and said in message
    assert f"fix the kube_config (or kube_config_path) extra of Connection {CONN}" in message
    assert "/tmp" not in message  # the hook's temporary copy is no help to the reader


def test_a_closed_port_refuses_the_run_naming_host_and_port(tmp_path, private_root, monkeypatch) -> None:
    port = _closed_port()
    monkeypatch.setenv(ENV, kubernetes_connection(kubeconfig(f"http://127.0.0.1:{port}", GOOD)))
    message = _refused(_estate(tmp_path), private_root, ONLY_K8S)
    assert f"connection refused at 127.0.0.1:{port}" in message
    assert f"check the server address in the kubeconfig of Connection {CONN}" in message
    assert GOOD not in message


def test_a_server_that_never_answers_is_given_the_estate_s_read_timeout(tmp_path, private_root, monkeypatch) -> None:
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        monkeypatch.setenv(ENV, kubernetes_connection(kubeconfig(f"http://127.0.0.1:{port}", GOOD)))
        message = _refused(_estate(tmp_path, read_timeout_s=0.3), private_root, ONLY_K8S)
    assert f"no answer from 127.0.0.1:{port} within 0.3 s" in message
    assert "placement.cluster_read_timeout_s" in message


@pytest.mark.parametrize(("token", "said", "fix"), [
    (STALE, "refused its credentials (401 Unauthorized)", f"renew the token or client certificate of the "
                                                          f"kubeconfig's user in Connection {CONN}"),
    (READ_ONLY, "may not list Volcano Jobs (batch.volcano.sh) in namespace hybridflow (403 Forbidden)",
     "grant the kubeconfig's user a Role in namespace hybridflow"),
], ids=["401", "403"])
def test_refused_credentials_refuse_the_run_and_never_show_the_token(tmp_path, private_root, monkeypatch, caplog,
                                                                     api_server, token, said, fix) -> None:
    url, seen = api_server
    monkeypatch.setenv(ENV, kubernetes_connection(kubeconfig(url, token)))
    with caplog.at_level(logging.DEBUG):
        message = _refused(_estate(tmp_path), private_root, ONLY_K8S)
    assert said in message and fix in message
    assert seen and all(auth == f"Bearer {token}" for _, auth in seen)  # it did present the token
    assert token not in message and token not in caplog.text


def test_a_broken_cluster_is_a_warning_when_another_cluster_may_take_the_run(tmp_path, private_root, monkeypatch,
                                                                             caplog) -> None:
    port = _closed_port()
    monkeypatch.setenv(ENV, kubernetes_connection(kubeconfig(f"http://127.0.0.1:{port}", GOOD)))
    with caplog.at_level(logging.WARNING, logger="hybridflow.conncheck"):
        run = admit(SPOT, _estate(tmp_path), private_root)
    assert run.spot_eligible
    warnings = [r.getMessage() for r in caplog.records if r.name == "hybridflow.conncheck"]
    assert len(warnings) == 1
    assert f"cluster {CLUSTER} (Connection {CONN}): connection refused at 127.0.0.1:{port}" in warnings[0]
    assert "Placement leaves the cluster out of this run" in warnings[0]


def test_a_cluster_the_run_cannot_use_is_not_probed(tmp_path, private_root, monkeypatch, caplog,
                                                     api_server) -> None:
    # H100s only on cloud-east: k8s-dc2 (A100s) is never a candidate for this run, so it is not asked.
    url, seen = api_server
    monkeypatch.setenv(ENV, kubernetes_connection(kubeconfig(url, GOOD)))
    with caplog.at_level(logging.WARNING, logger="hybridflow.conncheck"):
        run = admit({"gpu_type": "H100-80GB"}, _estate(tmp_path), private_root)
    assert run.gpu_type == "H100-80GB"
    assert not [r for r in caplog.records if r.name == "hybridflow.conncheck"]
    assert not seen
