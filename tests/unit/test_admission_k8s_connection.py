"""Admission probes the Connection of every Kubernetes cluster a run may use: a missing Connection, an
unreadable kubeconfig, a closed port, a silent server and refused credentials are named with the
cluster, the Connection and the fix. The run is refused when no cluster it may use is left, and
warned about otherwise. The real kubernetes client, built by the provider's hook from the Connection,
does the talking, to the cluster simulator served over HTTP (:mod:`tests.support.k8s_http`) or, below
HTTP, to a port nothing listens on and a socket that never replies."""

from __future__ import annotations

import logging
import shutil
import socket
from pathlib import Path

import pytest
import yaml
from tests.support.k8s_config import as_kubernetes, kubeconfig, kubernetes_connection
from tests.support.k8s_http import SimApiServer, serve
from tests.support.k8s_sim import SimCluster

from hybridflow.admission import admit
from hybridflow.config import Estate, load_estate
from hybridflow.errors import AdmissionError
from hybridflow.settings import REPO_ROOT

CLUSTER, CONN, ENV = "k8s-dc2", "k8s_dc2", "AIRFLOW_CONN_K8S_DC2"
GOOD, STALE = "good-token-7f3a9c", "stale-token-90d2e4"
ONLY_K8S = {"model": "breast-cancer"}  # restricted data: private clusters only, and k8s-dc2 is the private one
SPOT = {"interruptible": True, "spot_allowed": True}  # cloud-east's A100 spot pool may take it too
LISTS = {"volcano": "/apis/batch.volcano.sh/v1alpha1/namespaces/hybridflow/jobs",
         "kueue": "/apis/batch/v1/namespaces/hybridflow/jobs"}


@pytest.fixture
def sim() -> SimCluster:
    return SimCluster({"a100-1": {"gpus": 8}})


@pytest.fixture
def api(monkeypatch, sim) -> SimApiServer:
    """The cluster simulator behind the Kubernetes API on loopback, Connection k8s_dc2 pointing at it
    with token GOOD (the only one it accepts)."""
    with serve(monkeypatch, sim, CONN, token=GOOD) as server:
        yield server


def _seen(api: SimApiServer) -> list[tuple[str, str]]:
    """(path?query, Authorization) of every request the API server got."""
    return [(r.url.path_qs, r.headers.get("Authorization", "")) for r in api.handler]


@pytest.fixture(autouse=True)
def _own_client_defaults(monkeypatch) -> None:
    """The kubeconfig loader sets the client's process-wide default configuration: keep it to this test."""
    from kubernetes.client import Configuration

    monkeypatch.setattr(Configuration, "_default", None)
    monkeypatch.delenv(ENV, raising=False)  # the api fixture sets it, after this one


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
def test_a_cluster_whose_api_server_answers_is_admitted(tmp_path, private_root, api, sim, scheduler) -> None:
    run = admit(ONLY_K8S, _estate(tmp_path, scheduler), private_root)
    assert run.must_stay_private
    assert _seen(api) == [(f"{LISTS[scheduler]}?limit=1", f"Bearer {GOOD}")]  # one authenticated request
    assert [m for m, _ in sim.requests] == [
        "list_namespaced_custom_object" if scheduler == "volcano" else "list_namespaced_job"]


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


def test_a_closed_port_refuses_the_run_naming_host_and_port(tmp_path, private_root, api, sim) -> None:
    sim.unreachable = True  # the API server's port refuses connections
    message = _refused(_estate(tmp_path), private_root, ONLY_K8S)
    assert f"connection refused at 127.0.0.1:{api.port}" in message
    assert f"check the server address in the kubeconfig of Connection {CONN}" in message
    assert GOOD not in message and not sim.requests


def test_a_port_nothing_listens_on_refuses_the_run_naming_host_and_port(tmp_path, private_root, monkeypatch) -> None:
    port = _closed_port()
    monkeypatch.setenv(ENV, kubernetes_connection(kubeconfig(f"http://127.0.0.1:{port}", GOOD)))
    message = _refused(_estate(tmp_path), private_root, ONLY_K8S)
    assert f"cluster {CLUSTER} (Connection {CONN}): connection refused at 127.0.0.1:{port}" in message


def test_a_server_that_answers_too_late_is_given_the_estate_s_read_timeout(tmp_path, private_root, api, sim) -> None:
    sim.api_delay_s = 3.0
    message = _refused(_estate(tmp_path, read_timeout_s=0.3), private_root, ONLY_K8S)
    assert f"no answer from 127.0.0.1:{api.port} within 0.3 s" in message
    assert "placement.cluster_read_timeout_s" in message


def test_a_server_that_never_speaks_is_given_the_estate_s_read_timeout(tmp_path, private_root, monkeypatch) -> None:
    # Below HTTP: a socket that accepts connections (the kernel's backlog) and never replies.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        monkeypatch.setenv(ENV, kubernetes_connection(kubeconfig(f"http://127.0.0.1:{port}", GOOD)))
        message = _refused(_estate(tmp_path, read_timeout_s=0.3), private_root, ONLY_K8S)
    assert f"no answer from 127.0.0.1:{port} within 0.3 s" in message


def test_a_stale_token_refuses_the_run_and_is_never_shown(tmp_path, private_root, monkeypatch, caplog, api,
                                                          sim) -> None:
    monkeypatch.setenv(ENV, api.connection(token=STALE))
    with caplog.at_level(logging.DEBUG):
        message = _refused(_estate(tmp_path), private_root, ONLY_K8S)
    assert "refused its credentials (401 Unauthorized)" in message
    assert f"renew the token or client certificate of the kubeconfig's user in Connection {CONN}" in message
    assert _seen(api) and all(auth == f"Bearer {STALE}" for _, auth in _seen(api))  # it did present the token
    assert not sim.requests  # refused before anything else
    assert STALE not in message and STALE not in caplog.text


@pytest.mark.parametrize(("scheduler", "rule", "jobs"), [
    ("volcano", ("list", "jobs", "batch.volcano.sh"), "Volcano Jobs (batch.volcano.sh)"),
    ("kueue", ("list", "jobs", "batch"), "Jobs (batch)"),
])
def test_a_user_without_the_rbac_rule_refuses_the_run_naming_connection_and_rule(tmp_path, private_root, caplog,
                                                                                  api, sim, scheduler, rule,
                                                                                  jobs) -> None:
    sim.forbidden.add(rule)  # the API server's 403 Status for list jobs in namespace hybridflow
    with caplog.at_level(logging.DEBUG):
        message = _refused(_estate(tmp_path, scheduler), private_root, ONLY_K8S)
    assert f"cluster {CLUSTER} (Connection {CONN}): its user may not list {jobs} in namespace hybridflow " \
           "(403 Forbidden)" in message
    assert f"grant the kubeconfig's user a Role in namespace hybridflow to manage {jobs}" in message
    assert _seen(api) == [(f"{LISTS[scheduler]}?limit=1", f"Bearer {GOOD}")]
    assert GOOD not in message and GOOD not in caplog.text


def test_a_broken_cluster_is_a_warning_when_another_cluster_may_take_the_run(tmp_path, private_root, caplog, api,
                                                                             sim) -> None:
    sim.unreachable = True
    with caplog.at_level(logging.WARNING, logger="hybridflow.conncheck"):
        run = admit(SPOT, _estate(tmp_path), private_root)
    assert run.spot_eligible
    warnings = [r.getMessage() for r in caplog.records if r.name == "hybridflow.conncheck"]
    assert len(warnings) == 1
    assert f"cluster {CLUSTER} (Connection {CONN}): connection refused at 127.0.0.1:{api.port}" in warnings[0]
    assert "Placement leaves the cluster out of this run" in warnings[0]


def test_a_cluster_the_run_cannot_use_is_not_probed(tmp_path, private_root, caplog, api, sim) -> None:
    # H100s only on cloud-east: k8s-dc2 (A100s) is never a candidate for this run, so it is not asked.
    with caplog.at_level(logging.WARNING, logger="hybridflow.conncheck"):
        run = admit({"gpu_type": "H100-80GB"}, _estate(tmp_path), private_root)
    assert run.gpu_type == "H100-80GB"
    assert not [r for r in caplog.records if r.name == "hybridflow.conncheck"]
    assert not _seen(api) and not sim.requests
