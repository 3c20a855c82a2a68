"""Byte-rate caps on uploads: one budget for staging, DR replication and checkpoint commits across the
processes of a machine, checkpoints first, and the caps travel with a gang's job spec."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridflow.storage.bandwidth import Cap, Throttle, endpoint_key
from hybridflow.storage.objectstore import StoreSpec, open_store
from hybridflow.storage.transfer import TransferSettings, Uploader, UploadItem

MiB = 1024 * 1024
REPO = Path(__file__).resolve().parents[2]


def _take_in_child(directory: Path, rate: float, total: int, priority: str = "bulk") -> subprocess.Popen:
    code = (
        "import sys; from pathlib import Path; from hybridflow.storage.bandwidth import Cap, Throttle\n"
        f"t = Throttle([Cap('endpoint:test', {rate})], priority={priority!r}, directory=Path({str(directory)!r}))\n"
        f"[t.take(1 << 20) for _ in range({total // MiB})]\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO)


def test_two_processes_under_one_cap_share_it(tmp_path: Path) -> None:
    rate, each = 32e6, 8 * MiB
    started = time.monotonic()
    children = [_take_in_child(tmp_path, rate, each) for _ in range(2)]
    assert [c.wait(timeout=60) for c in children] == [0, 0]
    elapsed = time.monotonic() - started
    # Alone, each would be done in each / rate (0.26 s): together they wait for each other.
    assert elapsed >= 0.95 * 2 * each / rate - 2 * MiB / rate, elapsed


def test_a_worker_forked_from_a_process_that_used_the_cap_shares_it(tmp_path: Path) -> None:
    # The local backend forks its gang workers from a warm process: the child must not share the
    # parent's open state file (flock would not keep them apart) nor a lock a parent thread held.
    rate = 32e6
    throttle = Throttle([Cap("endpoint:test", rate)], directory=tmp_path)
    throttle.take(MiB)
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            for _ in range(8):
                throttle.take(MiB)
        finally:
            os._exit(0)
    for _ in range(8):
        throttle.take(MiB)
    os.waitpid(pid, 0)
    assert time.monotonic() - started >= 0.95 * 15 * MiB / rate


def test_a_checkpoint_goes_first_while_bulk_uploads_hold_the_cap(tmp_path: Path) -> None:
    rate = 40e6
    bulk = Throttle([Cap("endpoint:test", rate)], directory=tmp_path)
    checkpoint = Throttle([Cap("endpoint:test", rate)], priority="checkpoint", directory=tmp_path)
    stop = threading.Event()

    def keep_sending() -> None:
        while not stop.is_set():
            bulk.take(MiB)

    senders = [threading.Thread(target=keep_sending) for _ in range(4)]
    for s in senders:
        s.start()
    try:
        time.sleep(0.3)
        started = time.monotonic()
        for _ in range(16):
            checkpoint.take(MiB)
        took = time.monotonic() - started
    finally:
        stop.set()
        for s in senders:
            s.join(timeout=10)
    # With a fair share among five senders it would take 5x as long (2.1 s); first, about 16 MiB / rate.
    assert took < 1.4 * 16 * MiB / rate, took


def test_a_bulk_upload_held_off_by_a_long_checkpoint_still_sends_a_step(tmp_path: Path, monkeypatch) -> None:
    # Its open request must not sit idle until the store's timeout cuts it (STARVE_S, 10 s; 0.3 s here).
    import hybridflow.storage.bandwidth as bandwidth

    monkeypatch.setattr(bandwidth, "STARVE_S", 0.3)
    rate = 8e6
    bulk = Throttle([Cap("endpoint:test", rate)], directory=tmp_path)
    checkpoint = Throttle([Cap("endpoint:test", rate)], priority="checkpoint", directory=tmp_path)
    done = threading.Event()

    def long_checkpoint() -> None:
        deadline = time.monotonic() + 5
        while not done.is_set() and time.monotonic() < deadline:
            checkpoint.take(MiB)

    committing = threading.Thread(target=long_checkpoint)
    committing.start()
    try:
        time.sleep(0.2)
        started = time.monotonic()
        bulk.take(MiB)
        waited = time.monotonic() - started
    finally:
        done.set()
        committing.join(timeout=10)
    assert 0.25 <= waited < 2.0, waited  # held off first, then one step while the checkpoint still goes


def test_caps_travel_in_the_spec_a_gang_worker_opens() -> None:
    cap = Cap(endpoint_key("http://127.0.0.1:9000/", "us-east-1"), 50e6)
    assert cap.key == "endpoint:http://127.0.0.1:9000"
    spec = StoreSpec(kind="s3", bucket="ckpt", endpoint_url="http://127.0.0.1:9000", caps=(cap,), priority="checkpoint")
    worker_side = StoreSpec.from_dict(json.loads(json.dumps(spec.to_dict())))  # through the job spec's JSON
    assert worker_side == spec
    store = open_store(worker_side)
    assert store.throttle is not None and store.throttle.caps == (cap,) and store.throttle.checkpoint
    plain = StoreSpec(kind="s3", bucket="ckpt", endpoint_url="http://127.0.0.1:9000")
    assert "caps" not in plain.to_dict() and open_store(plain).throttle is None  # no cap: nothing wrapped


def test_a_cluster_s_cache_places_carry_its_caps_and_checkpoints_go_first(tmp_path: Path, monkeypatch) -> None:
    import yaml
    from tests.unit.test_config import broken_copy

    from hybridflow.config import load_estate
    from hybridflow.placement.places import cache_store_spec, checkpoint_place_spec
    from hybridflow.settings import Settings

    def caps(data: dict) -> None:
        data["clusters"]["cloud-east"]["upload_cap"] = "80 MB/s"

    config = broken_copy(tmp_path, "clusters.yaml", caps)
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["bandwidth"] = {"endpoints": {"http://127.0.0.1:9999": "1 Gbit/s"}}
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_CACHE_CLOUD_EAST", json.dumps({
        "conn_type": "aws", "login": "ak-1234567890", "password": "sk-1234567890",
        "extra": {"endpoint_url": "http://127.0.0.1:9999"}}))
    cluster = load_estate(config, use_cache=False).clusters["cloud-east"]
    staging = cache_store_spec(cluster)
    assert staging.caps == (Cap("endpoint:http://127.0.0.1:9999", 125e6), Cap("cluster:cloud-east", 80e6))
    assert staging.priority == "bulk"
    ckpt = checkpoint_place_spec("cache", "run-1", cluster, Settings(home=tmp_path, config_dir=config))
    assert ckpt.caps == staging.caps and ckpt.priority == "checkpoint"
    assert StoreSpec.from_dict(ckpt.to_dict()).caps == staging.caps  # what a Kubernetes pod reads back


@pytest.fixture
def capped_endpoint(rclone_s3, tmp_path: Path, monkeypatch):
    endpoint, access, secret, _ = rclone_s3
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    base = StoreSpec(kind="s3", bucket="bandwidth-caps", endpoint_url=endpoint, access_key=access, secret_key=secret)
    open_store(base).ensure_bucket()
    return base, access, secret


def _files(folder: Path, sizes: list[int]) -> list[Path]:
    folder.mkdir(parents=True)
    out = []
    for i, size in enumerate(sizes):
        path = folder / f"f{i:03d}.bin"
        path.write_bytes(os.urandom(size))
        out.append(path)
    return out


def _items(paths: list[Path]) -> list[UploadItem]:
    import hashlib

    def reader(path: Path):
        return lambda offset, length: path.read_bytes()[offset:offset + length]

    return [UploadItem(key=f"staged/{p.name}", size=p.stat().st_size, sha256=hashlib.sha256(p.read_bytes()).hexdigest(),
                       md5=hashlib.md5(p.read_bytes()).hexdigest(), read=reader(p), path=str(p)) for p in paths]


def test_staging_replication_and_a_checkpoint_keep_one_cap_together(capped_endpoint, tmp_path: Path) -> None:
    base, access, secret = capped_endpoint
    rate = 24e6
    cap = (Cap(endpoint_key(base.endpoint_url, base.region), rate),)
    staged = _files(tmp_path / "dataset", [MiB] * 12 + [16 * MiB])  # small files (the CRT path uncapped) and parts
    replica = _files(tmp_path / "replica", [8 * MiB])[0]
    checkpoint = dataclasses.replace(base, prefix="checkpoints/run-1", caps=cap, priority="checkpoint")
    child_code = (
        "import json, os, sys, time; from hybridflow.storage.objectstore import StoreSpec, open_store\n"
        "from hybridflow.training.checkpoint import CheckpointStore\n"
        "store = open_store(StoreSpec.from_dict(json.loads(sys.argv[1])))\n"
        "store.exists('warm'); print('ready', flush=True)  # a gang's store is open already\n"
        "sys.stdin.readline(); time.sleep(0.4); t = time.monotonic()\n"
        "CheckpointStore(store).save(7, {'model.pt': os.urandom(8 << 20)})\n"
        "print(time.monotonic() - t)\n"
    )
    env = {**os.environ, **dataclasses.replace(base, access_key=access, secret_key=secret).credential_env()}
    gang = subprocess.Popen([sys.executable, "-c", child_code, json.dumps(checkpoint.to_dict())], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert gang.stdout.readline().strip() == "ready"
    gang.stdin.write("go\n")
    gang.stdin.flush()
    started = time.monotonic()  # the checkpoint starts 0.4 s into a stage of about 1.6 s
    settings = TransferSettings(workers=8, multipart_threshold=8 * MiB, part_size=5 * MiB)
    stager = threading.Thread(target=lambda: Uploader(open_store(dataclasses.replace(base, caps=cap)), settings)
                              .upload(_items(staged), uploads_prefix="staged/"))
    stager.start()
    open_store(dataclasses.replace(base, caps=cap)).put_file("replicas/model.bin", replica)  # DR replication's call
    stager.join(timeout=120)
    out = gang.stdout.read()
    gang.wait(timeout=120)
    elapsed = time.monotonic() - started
    assert gang.returncode == 0
    sent = sum(p.stat().st_size for p in staged) + replica.stat().st_size + 8 * MiB
    assert sent / elapsed <= 1.05 * rate, f"{sent / elapsed / 1e6:.1f} MB/s over a cap of {rate / 1e6} MB/s"
    assert sent / elapsed >= 0.6 * rate, f"{sent / elapsed / 1e6:.1f} MB/s: the cap was not used"
    # The checkpoint had the cap to itself: a third of it (shared fairly) would take 3x as long.
    assert float(out.strip()) < 1.6 * 8 * MiB / rate, out
    assert {i.key for i in open_store(base).list("")} >= {f"staged/{p.name}" for p in staged} | {"replicas/model.bin"}
