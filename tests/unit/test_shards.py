"""Packing small files into tar shards: the bytes are a plain, deterministic tar that any tar tool
reads, every member sits at the offset the manifest will name, and a file that changed after the
scan is refused by name."""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest

from hybridflow.errors import StagingError
from hybridflow.storage.shards import Member, ShardPlan, build_shard, shard_offsets

NAMES = [
    "a.bin",
    "class-3/img-00042.png",
    "x" * 100,  # the longest name a ustar block holds
    "y" * 101,  # one more: a PAX record
    "deep/" * 60 + "z.bin",  # 305 characters
    "données/échantillon-ü.bin",  # not ASCII: a PAX record
    "sizes/zero",
]


def _files() -> dict[str, bytes]:
    sizes = [1, 511, 512, 513, 4096, 65536, 0]
    return {name: hashlib.sha256(name.encode()).digest() * (size // 32) + b"!" * (size % 32)
            for name, size in zip(NAMES, sizes, strict=True)}


def _plan(files: dict[str, bytes], *, hashed: bool) -> ShardPlan:
    return ShardPlan(tuple(
        Member(p, len(d), hashlib.sha256(d).hexdigest() if hashed else "") for p, d in sorted(files.items())
    ))


def _reference_tar(files: dict[str, bytes]) -> bytes:
    """The same members written by tarfile itself (PAX, mtime 0, owner 0, mode 0644)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = (
                len(data), 0, 0o644, 0, 0, "", "")
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_a_shard_is_the_tar_that_tarfile_writes_and_any_tar_reader_opens():
    files = _files()
    plan = _plan(files, hashed=False)
    view, hashed = build_shard(plan, bytearray(plan.max_bytes), read=files.__getitem__)
    shard = bytes(view)
    assert len(shard) == plan.packed_size <= plan.max_bytes
    # byte for byte what tarfile writes (it then pads to a 10 KiB record with zeros)
    reference = _reference_tar(files)
    assert reference[: len(shard)] == shard and not reference[len(shard):].strip(b"\0")
    with tarfile.open(fileobj=io.BytesIO(shard)) as tar:
        assert {m.name: tar.extractfile(m).read() for m in tar.getmembers()} == files
    # each member's offset (from the plan alone, as the manifest records it) points at its bytes,
    # and the SHA-256s taken while packing are the files'
    offsets = shard_offsets(hashed)
    for m in hashed.members:
        assert shard[offsets[m.path] : offsets[m.path] + m.size] == files[m.path]
        assert m.sha256 == hashlib.sha256(files[m.path]).hexdigest()


def test_a_reused_buffer_packs_each_shard_exactly():
    big = {f"big/{i:03d}": bytes([i]) * 9000 for i in range(40)}
    small = {"s/one": b"1", "s/two": b"22"}
    buf = bytearray(_plan(big, hashed=True).max_bytes)
    first, _ = build_shard(_plan(big, hashed=True), buf, read=big.__getitem__)
    first = bytes(first)
    second, _ = build_shard(_plan(small, hashed=True), buf, read=small.__getitem__)
    assert bytes(second) == _reference_tar(small)[: len(second)]
    # a buffer too short for the plan is not overrun: a fresh one is used
    third, _ = build_shard(_plan(big, hashed=True), bytearray(10), read=big.__getitem__)
    assert bytes(third) == first


@pytest.mark.parametrize("change", ["grew", "shrank", "same size, other bytes"])
def test_a_file_changed_after_the_scan_is_refused_by_name(change, tmp_path):
    files = _files()
    plan = _plan(files, hashed=True)
    victim = "class-3/img-00042.png"
    changed = dict(files)
    changed[victim] = {
        "grew": files[victim] + b"x",
        "shrank": files[victim][:-1],
        "same size, other bytes": bytes(len(files[victim])),
    }[change]
    for rel, data in changed.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)

    def readinto(rel: str, view: memoryview) -> int:
        with open(tmp_path / rel, "rb", buffering=0) as fh:
            return fh.readinto(view)

    for reader in ({"read": changed.__getitem__}, {"read": changed.__getitem__, "readinto": readinto}):
        with pytest.raises(StagingError, match=f"{victim} changed after it was scanned.*re-run staging"):
            build_shard(plan, bytearray(plan.max_bytes), **reader)
