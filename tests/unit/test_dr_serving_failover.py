"""Serving failover and failback of the local target: a primary declared down has its gateway endpoint
served by a model server on the DR side, started from the replicated model; `up` moves serving back
only when the primary's version passes the deploy gate. Real model servers and a real gateway on
127.0.0.1; the primary's server is frozen (SIGSTOP) while the cluster is down. Every process started
is stopped by pid."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
from pathlib import Path

import pytest
import yaml
from tests.support import bundles
from tests.support.deploy_settings import quick_serving
from tests.support.serving import INT_DIGITS, http_call, predict_url, start_server, stop_process

from hybridflow.config import load_estate
from hybridflow.dr.failover.serving import fail_over, stop_server
from hybridflow.dr.fencing.drain import fence_and_drain
from hybridflow.dr.fencing.failback import declare_up
from hybridflow.fencing import down_clusters, read_fence
from hybridflow.serving.processes import alive
from hybridflow.serving.router import pick_backend
from hybridflow.settings import REPO_ROOT
from hybridflow.storage.objectstore import StoreSpec

REASON = "power loss in dc-1"
PRIMARY = "onprem-a"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(folder: Path, port: int, **gate) -> Path:
    """The shipped estate with a DR pool, the quick serving gate (its bars overridden by ``gate``)."""
    target = folder / "config"
    shutil.copytree(REPO_ROOT / "config", target)
    doc = yaml.safe_load((target / "clusters.yaml").read_text())
    doc["clusters"]["dr-west"] = {
        "location": "private", "region": "dc-2", "jurisdiction": "eu", "backend": "local", "role": "dr",
        "dr": {"min_gpus": 1}, "node_pools": [{"name": "a100", "gpu_model": "A100-80GB", "gpu_memory_gib": 80,
                                                "gpus": 2}],
        "prices": {"onprem": 0.5}, "cache": {"conn_id": "hybridflow_dr_west", "bucket": "hf-dr-west"}}
    (target / "clusters.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    pipeline = quick_serving(yaml.safe_load((target / "pipeline.yaml").read_text()))
    pipeline["serving"]["port"] = port
    pipeline["serving"]["gate"].update(gate)
    (target / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return target


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """digits v1 served behind the gateway for the primary, its bundle replicated to a DR store."""
    from hybridflow.dr.replication.replicas import replicate_set
    from hybridflow.dr.replication.sources import model_set
    from hybridflow.serving.deploy import stop_gateway
    from hybridflow.serving.gateway import ensure_gateway
    from hybridflow.storage.objectstore import LocalObjectStore

    base = tmp_path_factory.mktemp("failover")
    data = bundles.seed("digits-mlp", base / "data")
    bundle = bundles.make_bundle(base / "bundle-v1", "digits-mlp", bundles.train("digits-mlp", data, steps=30),
                                 version="v1", signature=INT_DIGITS)
    home, port = base / "home", _free_port()
    root = home / "state" / "serving"
    edir = root / "digits"
    (edir / "versions").mkdir(parents=True)
    proc, url = start_server(bundle, "digits", "v1", base)
    record = {"endpoint": "digits", "version": "v1", "bundle": str(bundle), "model": "digits-mlp", "pid": proc.pid,
              "url": url, "status": "active", "started_at": "2026-01-01T00:00:00+00:00"}
    (edir / "versions" / "v1.json").write_text(json.dumps(record))
    (edir / "active.json").write_text(json.dumps({"version": "v1", "url": url, "pid": proc.pid}))
    replicate_set(model_set("digits", record), LocalObjectStore(base / "dr-store"))
    ensure_gateway(root.resolve(), port, None)
    yield {"base": base, "home": home, "edir": edir, "port": port, "proc": proc, "url": url,
           "row": [int(v) for v in data.xy("test", 1)[0][0]], "dr_spec": StoreSpec(kind="local", root=str(base / "dr-store")),
           "estate": load_estate(_config(base / "quick", port), use_cache=False)}
    stop_gateway(root)
    stop_process(proc)


@pytest.fixture
def primary(served):
    """Each test starts with the primary up and serving v1 and no fence; a takeover server left by a
    test is stopped by pid (and must be gone)."""
    yield served
    edir = served["edir"]
    os.kill(served["proc"].pid, signal.SIGCONT)
    active = json.loads((edir / "active.json").read_text()) if (edir / "active.json").is_file() else {}
    if active.get("takeover"):
        stop_server(edir, active["takeover"])
        assert not alive(active["takeover"]["pid"])
    (edir / "active.json").write_text(json.dumps({"version": "v1", "url": served["url"], "pid": served["proc"].pid}))
    (served["home"] / "state" / "fencing.json").unlink(missing_ok=True)


def _down(served, dr_spec=None) -> dict:
    os.kill(served["proc"].pid, signal.SIGSTOP)  # the primary no longer answers
    return fence_and_drain(PRIMARY, REASON, by="ops", estate=served["estate"], state_dir=served["home"] / "state",
                           backend_factory=lambda *_: _NoGangs(), dr_spec=dr_spec or served["dr_spec"])


class _NoGangs:
    def find_gangs(self, labels, *, not_labels=None) -> list[str]:
        return []


def _through_gateway(served, n: int = 5) -> set[tuple[int, str]]:
    url = predict_url(f"http://127.0.0.1:{served['port']}", "digits")
    answers = [http_call("POST", url, {"instances": [served["row"]]}, timeout=5) for _ in range(n)]
    return {(status, headers.get("X-Model-Version")) for status, _, headers in answers}


def _healthz_pid(url: str) -> int:
    return http_call("GET", f"{url}/healthz")[1]["pid"]


def _fence(served) -> Path:
    return served["home"] / "state" / "fencing.json"


def test_the_local_gateway_stands_for_the_one_private_primary(tmp_path: Path) -> None:
    from hybridflow.dr.failover.serving import serving_cluster

    config = _config(tmp_path, 8790)
    assert serving_cluster(load_estate(config, use_cache=False))[0] == PRIMARY
    doc = yaml.safe_load((config / "clusters.yaml").read_text())
    doc["clusters"]["onprem-b"] = {**doc["clusters"][PRIMARY], "region": "dc-3"}
    (config / "clusters.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    estate = load_estate(config, use_cache=False)
    where, why = serving_cluster(estate)
    assert where is None and "clusters.yaml has 2 (onprem-a, onprem-b)" in why
    out = fail_over(PRIMARY, estate, tmp_path / "state")  # nothing moved, and the outcome says why
    assert out["entry"] is None and not out["drained"] and "onprem-b" in out["note"]


def test_the_gateway_sends_every_request_to_the_takeover_backend_ahead_of_the_canary(tmp_path: Path) -> None:
    from hybridflow.serving.router import NoBackend

    edir = tmp_path / "digits"
    edir.mkdir()
    active = {"version": "v1", "url": "http://127.0.0.1:9001",
              "canary": {"version": "v2", "url": "http://127.0.0.1:9002", "percent": 100}}
    (edir / "active.json").write_text(json.dumps({**active, "takeover": {"version": "v1", "url": "http://127.0.0.1:9003"}}))
    assert {pick_backend(edir, draw=d)["port"] for d in (0.0, 50.0, 99.9)} == {9003}
    (edir / "active.json").write_text(json.dumps({**active, "takeover": {"version": "v1", "url": "http://10.0.0.3:80"}}))
    with pytest.raises(NoBackend, match="127.0.0.1"):  # held to loopback like every backend
        pick_backend(edir)
    (edir / "active.json").write_text(json.dumps(active))
    assert pick_backend(edir, draw=0.0)["port"] == 9002


def test_down_serves_the_endpoint_from_the_replicated_model_on_the_dr_side_once(primary) -> None:
    out = _down(primary)
    serving = out["record"]["drain"]["serving"]
    assert serving["drained"] and serving["dr_cluster"] == "dr-west" and PRIMARY in serving["rule"]
    moved = serving["endpoints"]["digits"]
    dr = moved["dr"]
    assert moved["state"] == "on dr" and moved["primary"]["pid"] == primary["proc"].pid
    assert dr["source"] == "the active version v1, replicated" and dr["replica"] == "models/digits/v1/MANIFEST.json"
    assert dr["bundle"].startswith(str(primary["home"] / "scratch" / "dr-west" / "serving"))
    assert dr["pid"] != primary["proc"].pid and isinstance(dr["prediction"], int)
    # The primary's server is frozen; the gateway answers from the DR-side server.
    assert _through_gateway(primary) == {(200, "v1")}
    backend = pick_backend(primary["edir"])
    assert backend["url"] == dr["url"] and _healthz_pid(backend["url"]) == dr["pid"]
    assert down_clusters(_fence(primary))[PRIMARY]["drain"]["serving"] == serving  # kept with the fence
    # Declared down again: nothing is started twice; draining again finds the DR side serving.
    assert not _down(primary)["changed"]
    again = fail_over(PRIMARY, primary["estate"], primary["home"] / "state", dr_spec=primary["dr_spec"])
    assert again["endpoints"]["digits"]["dr"]["pid"] == dr["pid"]
    assert again["endpoints"]["digits"]["note"] == "served on the DR side already"


def test_up_with_a_primary_that_passes_the_gate_moves_serving_back_and_stops_the_dr_server(primary) -> None:
    dr = _down(primary)["record"]["drain"]["serving"]["endpoints"]["digits"]["dr"]
    os.kill(primary["proc"].pid, signal.SIGCONT)  # the primary is back
    change = declare_up(PRIMARY, by="ops", estate=primary["estate"], path=_fence(primary))
    assert change.changed and PRIMARY not in down_clusters(_fence(primary))
    back = change.record["serving"]
    assert back["moved_back"]
    digits = back["endpoints"]["digits"]
    assert digits["state"] == "on primary" and digits["gate"]["passed"] and digits["dr_stopped"]
    assert digits["gate"]["new"]["requests"] > 0 and digits["gate"]["serving"]["requests"] > 0  # side by side
    assert not alive(dr["pid"])
    assert "takeover" not in json.loads((primary["edir"] / "active.json").read_text())
    assert _through_gateway(primary) == {(200, "v1")}
    assert _healthz_pid(pick_backend(primary["edir"])["url"]) == primary["proc"].pid
    assert read_fence(_fence(primary))["history"][-1]["serving"] == back


def test_up_with_a_primary_that_fails_the_gate_keeps_serving_on_dr_and_a_later_up_retries(
        primary, monkeypatch, capsys) -> None:
    from hybridflow.cli import main

    dr = _down(primary)["record"]["drain"]["serving"]["endpoints"]["digits"]["dr"]
    os.kill(primary["proc"].pid, signal.SIGCONT)
    _config(primary["base"] / "strict", primary["port"], p99_ms=0.001)
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(primary["home"]))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(primary["base"] / "strict" / "config"))
    assert main(["cluster", "up", PRIMARY, "--by", "ops"]) == 3
    out = capsys.readouterr()
    assert "serving stays on the disaster-recovery side" in out.err and "serving.gate.p99_ms" in out.err
    # The fence is lifted for placement; serving stays on the DR side, and the record says why.
    record = json.loads(out.out)["record"]
    assert record["event"] == "up" and PRIMARY not in down_clusters(_fence(primary))
    digits = record["serving"]["endpoints"]["digits"]
    assert not record["serving"]["moved_back"] and digits["state"] == "on dr"
    assert "above the gate's 0.001 ms (serving.gate.p99_ms)" in digits["reason"]
    assert not digits["gate"]["passed"] and digits["gate"]["new"]["requests"] > 0
    assert "until a later `hybridflow cluster up` passes" in digits["reason"]
    assert alive(dr["pid"]) and pick_backend(primary["edir"])["url"] == dr["url"]
    assert _through_gateway(primary) == {(200, "v1")}
    assert read_fence(_fence(primary))["history"][-1]["serving"] == record["serving"]
    # The cluster_fence DAG's task, run again with the same bars, retries and fails naming why.
    from airflow.sdk.exceptions import AirflowFailException

    from hybridflow.dr.fencing.task import fence_task

    with pytest.raises(AirflowFailException, match=r"serving stays on the disaster-recovery side: .*serving.gate.p99_ms"):
        fence_task({"action": "up", "cluster": PRIMARY}, by="ops")
    assert alive(dr["pid"]) and pick_backend(primary["edir"])["url"] == dr["url"]
    # With bars the primary meets, a later `up` (the cluster is up already) retries and moves serving back.
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(primary["base"] / "quick" / "config"))
    assert main(["cluster", "up", PRIMARY]) == 0
    retry = json.loads(capsys.readouterr().out)["record"]
    assert retry["event"] == "serving failback" and retry["serving"]["moved_back"]
    assert [e["event"] for e in read_fence(_fence(primary))["history"]] == ["down", "up", "serving failback",
                                                                        "serving failback"]
    assert not alive(dr["pid"]) and _healthz_pid(pick_backend(primary["edir"])["url"]) == primary["proc"].pid


def test_down_without_a_replicated_model_says_so_and_changes_no_routing(primary) -> None:
    before = (primary["edir"] / "active.json").read_text()
    empty = StoreSpec(kind="local", root=str(primary["base"] / "empty-dr-store"))
    Path(empty.root).mkdir(exist_ok=True)
    serving = _down(primary, dr_spec=empty)["record"]["drain"]["serving"]
    digits = serving["endpoints"]["digits"]
    assert not serving["drained"] and digits["state"] == "not moved"
    assert digits["reason"].startswith("no model of digits is replicated to the DR store")
    assert digits["reason"].endswith("serving left as it was")
    assert (primary["edir"] / "active.json").read_text() == before
    assert pick_backend(primary["edir"])["url"] == primary["url"]
    # Nothing on the DR side: `up` lifts the fence and has no serving to move back.
    change = declare_up(PRIMARY, estate=primary["estate"], path=_fence(primary))
    assert change.changed and "none was moved back" in change.record["serving"]


def test_stopping_an_endpoint_stops_its_dr_side_server_too(tmp_path: Path) -> None:
    """``hybridflow dev down`` (stop_endpoint) leaves no DR-side server of a taken-over endpoint behind."""
    import subprocess
    import sys
    import time

    from hybridflow.serving.deploy import stop_endpoint

    edir = tmp_path / "serving" / "digits"
    (edir / "takeover").mkdir(parents=True)
    ready = edir / "takeover" / "v1.ready"
    # A process that reads as the DR-side server of v1 (module and ready file on its command line).
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "hybridflow.serving.server",
                             "--ready-file", str(ready)])
    try:
        deadline = time.monotonic() + 5
        while not Path(f"/proc/{proc.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.02)  # the command line reads empty for a moment after the spawn
        (edir / "active.json").write_text(json.dumps({"version": "v0", "takeover": {"version": "v1", "pid": proc.pid}}))
        assert stop_endpoint(tmp_path / "serving", "digits")["stopped_pids"] == [proc.pid]
        assert proc.wait(timeout=10) is not None and not (edir / "active.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_endpoint_that_fails_over_with_an_error_leaves_the_others_moved_and_a_rerun_retries_it(primary) -> None:
    from hybridflow.dr.fencing.drain import DrainIncomplete

    # A DR store whose replica of another endpoint, listed before digits, has a manifest cut short.
    store = primary["base"] / "dr-store-corrupt"
    shutil.rmtree(store, ignore_errors=True)
    shutil.copytree(primary["dr_spec"].root, store)
    corrupt = store / "models" / "aaa" / "v1" / "MANIFEST.json"
    corrupt.parent.mkdir(parents=True)
    corrupt.write_text('{"version": "v1", "objects": [')
    other = primary["edir"].parent / "aaa"
    other.mkdir()
    (other / "active.json").write_text(json.dumps({"version": "v1", "url": "http://127.0.0.1:9"}))
    spec = StoreSpec(kind="local", root=str(store))
    try:
        with pytest.raises(DrainIncomplete, match=r"endpoint aaa: JSONDecodeError") as failed:
            _down(primary, dr_spec=spec)
        serving = failed.value.out["record"]["drain"]["serving"]
        moved = serving["endpoints"]["digits"]
        assert serving["endpoints"]["aaa"]["state"] == "failed" and moved["state"] == "on dr"
        assert _through_gateway(primary) == {(200, "v1")}  # digits answers from the DR side meanwhile
        assert down_clusters(_fence(primary))[PRIMARY]["drain"]["complete"] is False

        corrupt.unlink()
        again = _down(primary, dr_spec=spec)["record"]["drain"]
        assert again["complete"] and again["serving"]["endpoints"]["aaa"]["state"] == "not moved"
        assert again["serving"]["endpoints"]["digits"]["dr"]["pid"] == moved["dr"]["pid"]  # not started twice
        assert again["serving"]["endpoints"]["digits"]["note"] == "served on the DR side already"
    finally:
        shutil.rmtree(other)
