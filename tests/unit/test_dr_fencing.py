"""Declaring a cluster down: the fence, placement in a takeover, draining, failback and bad input."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.support.dr_config import config_with_dr

from hybridflow.config import Estate, load_estate
from hybridflow.dr.fencing.drain import fence_and_drain
from hybridflow.dr.fencing.failback import declare_up
from hybridflow.errors import PlacementError
from hybridflow.fencing import FencingError, declare_down, down_clusters, fence_status, read_fence
from hybridflow.placement import PlacementDecision, choose_cluster
from hybridflow.placement.takeover import PlacementHeld, Takeover
from hybridflow.request import AdmittedRun

REASON = "power loss in dc-1"


_config = config_with_dr


@pytest.fixture
def estate(tmp_path: Path) -> Estate:
    return load_estate(_config(tmp_path), use_cache=False)


@pytest.fixture
def fence(tmp_path: Path) -> Path:
    return tmp_path / "state" / "fencing.json"


@pytest.fixture
def run_for() -> Callable[..., AdmittedRun]:
    """A run as admission hands it on (placement reads nothing else): the shipped example's project and
    internal data, the Params' defaults unless given."""

    def make(estate: Estate, **params) -> AdmittedRun:
        return AdmittedRun(model="digits", dataset="digits", project="digits-ocr", classification="internal",
                           team="perception", dataset_location="private://datasets/digits", **params)

    return make


def _place(run: AdmittedRun, estate: Estate, fence: Path, used: dict | None = None) -> PlacementDecision:
    return choose_cluster(run, estate, used or {}, takeover=Takeover.of(estate, down_clusters(fence)))


def _candidate(candidates: list[dict], name: str) -> dict:
    return next(c for c in candidates if c["cluster"] == name)


# -- placement while a primary is down ----------------------------------------------------------
def test_a_critical_run_lands_on_the_dr_pool_while_the_primary_is_down(estate: Estate, fence: Path, run_for) -> None:
    run = run_for(estate, priority="critical")
    assert _place(run, estate, fence).cluster == "onprem-a"  # before: the primary, never the DR pool
    declare_down("onprem-a", REASON, by="ops", estate=estate, path=fence)
    d = _place(run, estate, fence)
    # dr.peacetime names only batch; in a takeover the pool serves critical runs all the same.
    assert (d.cluster, d.node_pool) == ("dr-west", "a100")
    assert f"takeover (primary onprem-a declared down: {REASON}): critical runs go to the disaster-recovery pool " \
           "dr-west" in d.reasons
    primary = _candidate(d.candidates, "onprem-a")
    assert not primary["eligible"]
    assert primary["rules"]["fenced"].startswith("declared down at ")
    assert f"by ops: {REASON}; it takes no new placements until `hybridflow cluster up onprem-a`" in \
        primary["rules"]["fenced"]
    assert _candidate(d.candidates, "dr-west")["rules"]["fenced"] == "pass"  # recorded everywhere while one is down


def test_a_normal_run_waits_for_the_primary_and_is_not_placed_on_dr(estate: Estate, fence: Path, run_for) -> None:
    declare_down("onprem-a", REASON, estate=estate, path=fence)
    with pytest.raises(PlacementHeld) as held:
        _place(run_for(estate, priority="normal"), estate, fence)
    err = held.value
    assert (err.state, err.waits_for) == ("waiting", ["onprem-a"])
    assert "it waits for failback (`hybridflow cluster up onprem-a`) or for capacity elsewhere" in err.reason
    assert "normal runs are not placed on the disaster-recovery pool" in err.reason
    assert str(err).startswith("waiting: onprem-a would take the run but is declared down")
    dr = _candidate(err.candidates, "dr-west")
    assert not dr["eligible"]
    assert "normal runs are not placed there, they wait for the primary" in dr["rules"]["role"]
    assert isinstance(err, PlacementError)  # the placement step refuses it like any run no cluster takes now


def test_a_batch_run_is_paused_everywhere_during_a_takeover(estate: Estate, fence: Path, run_for) -> None:
    run = run_for(estate, priority="batch", interruptible=True, spot_allowed=True)
    assert _place(run, estate, fence, {"onprem-a": 4}).cluster == "cloud-east"  # peacetime: spills to spot
    declare_down("onprem-a", REASON, estate=estate, path=fence)
    with pytest.raises(PlacementHeld) as held:
        _place(run, estate, fence, {"onprem-a": 4})
    err = held.value
    assert err.state == "paused"
    assert err.reason == (f"estate in takeover (primary onprem-a declared down: {REASON}): batch runs are paused "
                          "until failback (`hybridflow cluster up onprem-a`)")
    # cloud-east's spot pool would take it otherwise: every cluster records the pause.
    assert all(c["rules"]["takeover"] == err.reason for c in err.candidates)
    assert _candidate(err.candidates, "cloud-east")["rules"]["spot"] == "pass"


def test_a_down_elastic_cluster_takes_no_new_placements_and_is_no_takeover(estate: Estate, fence: Path,
                                                                           run_for) -> None:
    spot = {"interruptible": True, "spot_allowed": True}
    assert _place(run_for(estate, **spot), estate, fence, {"onprem-a": 4}).cluster == "cloud-east"  # spill
    declare_down("cloud-east", "region outage", estate=estate, path=fence)
    d = _place(run_for(estate, **spot), estate, fence, {"onprem-a": 4})
    assert d.cluster == "onprem-a"  # queues on the busy primary instead
    assert "region outage" in _candidate(d.candidates, "cloud-east")["rules"]["fenced"]
    assert "takeover" not in _candidate(d.candidates, "cloud-east")["rules"]  # a primary is up: no takeover
    assert _candidate(d.candidates, "dr-west")["rules"]["role"].startswith("role dr: only batch runs in peacetime")
    with pytest.raises(PlacementHeld, match="waiting: cloud-east would take the run but is declared down"):
        _place(run_for(estate, cluster_preference="public", **spot), estate, fence)


def test_up_restores_normal_placement(estate: Estate, fence: Path, run_for) -> None:
    declare_down("onprem-a", REASON, estate=estate, path=fence)
    change = declare_up("onprem-a", by="ops", estate=estate, path=fence)
    assert change.changed and change.record["down_reason"] == REASON
    assert "serving returns to the cluster only through a deploy" in change.record["serving"]
    for priority in ("critical", "normal"):
        d = _place(run_for(estate, priority=priority), estate, fence)
        assert d.cluster == "onprem-a"
        assert "fenced" not in _candidate(d.candidates, "onprem-a")["rules"]
    assert _place(run_for(estate, priority="batch"), estate, fence, {"onprem-a": 4}).cluster == "dr-west"
    assert [e["event"] for e in read_fence(fence)["history"]] == ["down", "up"]
    assert down_clusters(fence) == {}


# -- the fence itself ---------------------------------------------------------------------------
def test_declaring_twice_changes_nothing_the_second_time(estate: Estate, fence: Path) -> None:
    first = declare_down("onprem-a", REASON, by="ops", estate=estate, path=fence)
    written = fence.read_bytes()
    again = declare_down("onprem-a", "another reason", by="someone else", estate=estate, path=fence)
    assert first.changed and not again.changed
    assert again.record == first.record  # who, when and why of the first declaration stand
    assert fence.read_bytes() == written
    declare_up("onprem-a", estate=estate, path=fence)
    written = fence.read_bytes()
    assert not declare_up("onprem-a", estate=estate, path=fence).changed
    assert fence.read_bytes() == written


@pytest.mark.parametrize(
    ("cluster", "reason", "fragment"),
    [
        ("nowhere", REASON, "cluster 'nowhere' is not in clusters.yaml; use one of: cloud-east, onprem-a"),
        ("dr-west", REASON, "cluster 'dr-west' is the disaster-recovery pool (role: dr)"),
        ("onprem-a", "  ", "reason is empty: say why the cluster is declared down (--reason)"),
    ],
    ids=["unknown-cluster", "the-dr-cluster", "empty-reason"],
)
def test_bad_input_is_refused_by_name_and_changes_nothing(estate: Estate, fence: Path, cluster: str, reason: str,
                                                          fragment: str) -> None:
    declare_down("cloud-east", "region outage", estate=estate, path=fence)
    before = fence.read_bytes()
    with pytest.raises(FencingError) as err:
        declare_down(cluster, reason, estate=estate, path=fence)
    assert fragment in str(err.value)
    assert fence.read_bytes() == before


def test_no_dr_cluster_configured_is_refused_and_nothing_is_written(tmp_path: Path, fence: Path) -> None:
    shipped = load_estate(_config(tmp_path, with_dr=False), use_cache=False)
    with pytest.raises(FencingError, match="no cluster in clusters.yaml has role: dr, so nothing would take over"):
        declare_down("onprem-a", REASON, estate=shipped, path=fence)
    assert not fence.exists()


# -- draining, and the command ------------------------------------------------------------------
class _Backend:
    def __init__(self, gangs: list[str], fail: Exception | None = None) -> None:
        self.gangs, self.fail, self.stopped = gangs, fail, []

    def find_gangs(self, labels, *, not_labels=None) -> list[str]:
        if self.fail:
            raise self.fail
        return list(self.gangs)

    def stop(self, name: str, reason: str) -> bool:
        self.stopped.append((name, reason))
        return True


def test_down_checkpoints_the_cluster_s_gangs_once_and_keeps_the_outcome(estate: Estate, tmp_path: Path) -> None:
    backend = _Backend(["train-a", "train-b"])
    out = fence_and_drain("onprem-a", REASON, estate=estate, state_dir=tmp_path / "state",
                          backend_factory=lambda *_: backend)
    assert backend.stopped == [(g, f"cluster onprem-a declared down: {REASON}") for g in ("train-a", "train-b")]
    drain = down_clusters(tmp_path / "state" / "fencing.json")["onprem-a"]["drain"]
    assert drain == out["record"]["drain"]
    assert drain["gangs"] == {"answered": True, "stopped": ["train-a", "train-b"], "gone": []}
    assert drain["serving"]["entry"] is None and "serving.target local" in drain["serving"]["note"]
    again = fence_and_drain("onprem-a", REASON, estate=estate, state_dir=tmp_path / "state",
                            backend_factory=lambda *_: backend)
    assert not again["changed"] and len(backend.stopped) == 2


def test_a_cluster_that_does_not_answer_is_fenced_all_the_same(estate: Estate, tmp_path: Path) -> None:
    out = fence_and_drain("onprem-a", REASON, estate=estate, state_dir=tmp_path / "state",
                          backend_factory=lambda *_: _Backend([], fail=ConnectionError("no route to host")))
    assert out["changed"]
    assert out["record"]["drain"]["gangs"] == {"answered": False, "error": "ConnectionError: no route to host",
                                               "stopped": [], "gone": []}
    assert "onprem-a" in down_clusters(tmp_path / "state" / "fencing.json")


def test_the_command_fences_places_and_fails_back(tmp_path: Path, monkeypatch, capsys, run_for) -> None:
    from hybridflow.backends.base import ClusterLoad
    from hybridflow.cli import main
    from hybridflow.placement import place

    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(_config(tmp_path)))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    assert main(["cluster", "down", "nowhere", "--reason", REASON]) == 2
    assert "hybridflow cluster down: cluster 'nowhere' is not in clusters.yaml" in capsys.readouterr().err
    assert main(["cluster", "down", "onprem-a"]) == 2
    assert "reason is empty" in capsys.readouterr().err
    assert main(["cluster", "up", "nowhere"]) == 2
    assert "use one of: cloud-east, dr-west, onprem-a" in capsys.readouterr().err
    assert not (tmp_path / "home" / "state" / "fencing.json").exists()

    assert main(["cluster", "down", "onprem-a", "--reason", REASON, "--by", "ops"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["changed"] and out["record"]["drain"]["gangs"] == {"answered": True, "stopped": [], "gone": []}
    assert main(["cluster", "status"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["takeover"] and status["clusters"]["onprem-a"]["state"] == "down"
    assert status == fence_status(path=tmp_path / "home" / "state" / "fencing.json")

    estate = load_estate(tmp_path / "config", use_cache=False)
    loads = {n: ClusterLoad(n, c.total_gpus) for n, c in estate.clusters.items()}
    assert place(run_for(estate, priority="critical"), estate, loads).cluster == "dr-west"  # read from the fence
    assert main(["cluster", "up", "onprem-a"]) == 0
    assert json.loads(capsys.readouterr().out)["changed"]
    assert place(run_for(estate, priority="critical"), estate, loads).cluster == "onprem-a"


def test_the_dag_s_task_declares_as_the_triggering_user_and_fails_bad_params(tmp_path: Path, monkeypatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from hybridflow.dr.fencing.task import fence_task

    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(_config(tmp_path)))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    path = tmp_path / "home" / "state" / "fencing.json"
    for params, fragment in [({"action": "down", "cluster": "dr-west", "reason": REASON}, "disaster-recovery pool"),
                             ({"action": "down", "cluster": None, "reason": REASON}, "cluster: empty"),
                             ({"action": "down", "cluster": "onprem-a", "reason": None}, "reason is empty")]:
        with pytest.raises(AirflowFailException, match=fragment):
            fence_task(params, by="alice")
    assert not path.exists()
    out = fence_task({"action": "down", "cluster": "onprem-a", "reason": REASON}, by="alice")
    assert out["changed"] and down_clusters(path)["onprem-a"]["by"] == "alice"
    assert fence_task({"action": "up", "cluster": "onprem-a"}, by="alice")["record"]["by"] == "alice"
    assert down_clusters(path) == {}


# -- a drain that fails half way: kept, named, resumed by a rerun --------------------------------
class _Cluster(_Backend):
    """A backend whose stopped gangs are gone, as on a real cluster: a second drain finds none."""

    def stop(self, name: str, reason: str) -> bool:
        self.gangs.remove(name)
        return super().stop(name, reason)


def _gateway_endpoints(state: Path, *names: str) -> None:
    """Endpoints the model gateway serves for the primary (their server's address is never asked:
    the failover reads the DR store first)."""
    for name in names:
        (state / "serving" / name).mkdir(parents=True)
        (state / "serving" / name / "active.json").write_text(json.dumps({"version": "v1", "url": "http://127.0.0.1:9"}))


def test_a_drain_that_fails_is_kept_named_and_resumed_by_a_rerun(estate: Estate, tmp_path: Path) -> None:
    from hybridflow.dr.fencing.drain import DrainIncomplete
    from hybridflow.storage.objectstore import StoreSpec

    state, store = tmp_path / "state", tmp_path / "dr-store"
    _gateway_endpoints(state, "aaa", "digits")
    corrupt = store / "models" / "aaa" / "v1" / "MANIFEST.json"
    corrupt.parent.mkdir(parents=True)
    corrupt.write_text('{"version": "v1", "objects": [')  # cut short
    backend, spec = _Cluster(["train-a"]), StoreSpec(kind="local", root=str(store))

    def down() -> dict:
        return fence_and_drain("onprem-a", REASON, estate=estate, state_dir=state, backend_factory=lambda *_: backend,
                               dr_spec=spec)

    with pytest.raises(DrainIncomplete) as failed:
        down()
    message = str(failed.value)
    assert "onprem-a is declared down (no new placements), but its drain did not complete" in message
    assert "endpoint aaa: JSONDecodeError" in message
    assert f"run `hybridflow cluster down onprem-a --reason '{REASON}'` again" in message
    # The fence stands and the drain is kept with it, every part done but the failed one.
    drain = down_clusters(state / "fencing.json")["onprem-a"]["drain"]
    assert drain["complete"] is False and drain["failures"] == failed.value.failures
    assert drain["gangs"]["stopped"] == ["train-a"]
    assert drain["serving"]["endpoints"]["aaa"]["state"] == "failed"
    assert drain["serving"]["endpoints"]["digits"]["state"] == "not moved"  # the next endpoint was still tried
    assert failed.value.out["record"]["drain"] == drain

    corrupt.unlink()  # the manifest repaired (here: no model of aaa replicated any more)
    again = down()
    assert not again["changed"] and again["record"]["drain"]["complete"] is True
    assert again["record"]["drain"]["serving"]["endpoints"]["aaa"]["state"] == "not moved"
    assert len(backend.stopped) == 1  # the gang was stopped once
    kept = down_clusters(state / "fencing.json")["onprem-a"]
    assert kept["drain"] == again["record"]["drain"] and kept["reason"] == REASON
    third = down()  # drained completely: nothing is drained again
    assert third["record"]["drain"]["at"] == kept["drain"]["at"]
    assert [e["event"] for e in read_fence(state / "fencing.json")["history"]] == ["down"]


def _printed(stdout: str) -> dict:
    """The command's JSON on stdout (Airflow's Connection look-up logs there too)."""
    return json.loads(re.search(r"^\{$.*^\}$", stdout, re.M | re.S).group(0))


def test_the_command_exits_4_naming_a_store_error_and_a_rerun_completes_the_drain(
        tmp_path: Path, monkeypatch, capsys, rclone_s3) -> None:
    from hybridflow.cli import main
    from hybridflow.devenv.rclone import airflow_conn_uri
    from hybridflow.storage.s3 import S3ObjectStore

    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(_config(tmp_path)))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    _gateway_endpoints(tmp_path / "home" / "state", "digits")
    # The DR store does not answer: the failover's first read of it raises a botocore error.
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_DR_WEST", "aws://key:secret@?endpoint_url=http%3A%2F%2F127.0.0.1%3A9")
    assert main(["cluster", "down", "onprem-a", "--reason", REASON, "--by", "ops"]) == 4
    out = capsys.readouterr()
    assert "hybridflow cluster down: onprem-a is declared down (no new placements), but its drain did not " \
           "complete" in out.err and "endpoint digits: EndpointConnectionError" in out.err
    assert f"run `hybridflow cluster down onprem-a --reason '{REASON}'` again" in out.err
    assert main(["cluster", "status"]) == 0
    assert _printed(capsys.readouterr().out)["clusters"]["onprem-a"]["down"]["drain"]["complete"] is False

    endpoint, access, secret, _ = rclone_s3  # the DR store answers again
    S3ObjectStore("hf-dr-west", endpoint_url=endpoint, access_key=access, secret_key=secret).ensure_bucket()
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_DR_WEST", airflow_conn_uri(access, secret, endpoint))
    assert main(["cluster", "down", "onprem-a", "--reason", "a second reason"]) == 0
    record = _printed(capsys.readouterr().out)["record"]
    assert record["reason"] == REASON and record["by"] == "ops"  # the first declaration stands
    assert record["drain"]["complete"] is True
    assert record["drain"]["serving"]["endpoints"]["digits"]["reason"].startswith("no model of digits is replicated")


# -- the fence file: durable, and never read as "no cluster is down" -----------------------------
def test_each_fence_write_reaches_the_disk_before_and_after_the_rename(estate: Estate, fence: Path,
                                                                        monkeypatch) -> None:
    import os

    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def spy_replace(src, dst) -> None:
        events.append(("replace", f"{src} -> {dst}"))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    declare_down("onprem-a", REASON, estate=estate, path=fence)
    tmp = fence.with_suffix(f".tmp{os.getpid()}")
    assert events == [("fsync", str(tmp)), ("replace", f"{tmp} -> {fence}"), ("fsync", str(fence.parent))]
    events.clear()
    declare_up("onprem-a", estate=estate, path=fence)
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"] and down_clusters(fence) == {}


@pytest.mark.parametrize("damage, what", [
    (lambda p: p.write_text(""), "is empty"),
    (lambda p: p.write_text('{"down": {"onprem-a": {"reason": "pow'), "is not valid JSON"),
    (lambda p: p.write_text("[]"), "is not a fence"),
    (lambda p: p.mkdir(), "cannot be read (IsADirectoryError"),
], ids=["empty", "cut-short", "not-a-fence", "unreadable"])
def test_an_empty_or_unreadable_fence_is_an_error_naming_the_file_never_no_cluster_down(
        tmp_path: Path, monkeypatch, capsys, run_for, damage, what) -> None:
    from hybridflow.backends.base import ClusterLoad
    from hybridflow.cli import main
    from hybridflow.placement import place

    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(_config(tmp_path)))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    path = tmp_path / "home" / "state" / "fencing.json"
    path.parent.mkdir(parents=True)
    damage(path)
    expected = rf"the fence file {path} {re.escape(what)}.*so which clusters are declared down is unknown"
    with pytest.raises(FencingError, match=expected) as refused:
        down_clusters(path)
    assert f"mv {path} {path}.bad" in str(refused.value)
    estate = load_estate(tmp_path / "config", use_cache=False)
    loads = {n: ClusterLoad(n, c.total_gpus) for n, c in estate.clusters.items()}
    with pytest.raises(FencingError, match=expected):  # placement does not guess that onprem-a is up
        place(run_for(estate, priority="critical"), estate, loads)
    assert main(["cluster", "status"]) == 2
    assert re.search(expected, capsys.readouterr().err)
    assert main(["cluster", "down", "onprem-a", "--reason", REASON]) == 2  # nothing written over the damage
    capsys.readouterr()
    with pytest.raises(FencingError, match=expected):
        down_clusters(path)
