"""Small files packed into shards: a few large sequential objects instead of thousands of tiny
ones, which object stores and training loaders both handle far faster.

A shard is a plain POSIX tar (readable with ``tar -tf``) written deterministically: members in
path order, mtime 0, owner 0, mode 0644. The same files therefore always give the same bytes, so a
shard is content-addressed like any blob and an unchanged dataset re-stages nothing.

Which files share a shard is decided by their paths, not just by running sizes: a shard is closed
at the first file past ``target_size`` whose path hash ends in a chosen bit pattern (or at
``max_size``). Changing, adding or removing one file then changes one or two shards, not every
shard after it.

Every member keeps its own size, SHA-256 and offset in the dataset manifest, so a reader checks
each sample, and can fetch one sample with a ranged read.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hybridflow.errors import StagingError

_BLOCK = 512
_BOUNDARY_MASK = 0x7  # about one path in eight may end a shard once it is past target_size


@dataclass(frozen=True)
class Member:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ShardPlan:
    members: tuple[Member, ...]

    @property
    def hashed(self) -> bool:
        return all(m.sha256 for m in self.members)

    @property
    def members_digest(self) -> str:
        """Identity of the member list: equal digests pack to identical bytes."""
        h = hashlib.sha256(b"hybridflow.shard/v1\n")
        for m in self.members:
            h.update(f"{m.path}\0{m.size}\0{m.sha256}\n".encode())
        return h.hexdigest()

    @property
    def payload_bytes(self) -> int:
        return sum(m.size for m in self.members)

    @property
    def packed_size(self) -> int:
        """The exact size of the packed tar (headers and padding follow from paths and sizes)."""
        return sum(len(_tar_header(m.path, m.size)) + _padded(m.size) for m in self.members) + 2 * _BLOCK

    @property
    def max_bytes(self) -> int:
        """Upper bound of the packed size (headers, long-name records, padding, end blocks)."""
        return sum(3 * _BLOCK + len(m.path.encode()) + _padded(m.size) for m in self.members) + 2 * _BLOCK


def _padded(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


def plan_shards(members: list[Member], *, target_size: int, max_size: int) -> list[ShardPlan]:
    """Group ``members`` (any order) into shards of about ``target_size`` payload bytes."""
    if not 0 < target_size <= max_size:
        raise ValueError(f"shard target_size {target_size} must be positive and at most max_size {max_size}")
    shards: list[ShardPlan] = []
    current: list[Member] = []
    size = 0
    for m in sorted(members, key=lambda m: m.path):
        if current and size + m.size > max_size:
            shards.append(ShardPlan(tuple(current)))
            current, size = [], 0
        current.append(m)
        size += m.size
        boundary = hashlib.sha256(m.path.encode()).digest()[0] & _BOUNDARY_MASK == 0
        if size >= target_size and boundary:
            shards.append(ShardPlan(tuple(current)))
            current, size = [], 0
    if current:
        shards.append(ShardPlan(tuple(current)))
    return shards


def _tar_header(path: str, size: int) -> bytes:
    info = tarfile.TarInfo(path)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    # PAX adds an extended header only for names that do not fit ustar; the data offset is what
    # tobuf() returns either way.
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def shard_offsets(plan: ShardPlan) -> dict[str, int]:
    """Where each member's bytes start in the packed shard; a function of the plan alone, so a
    shard that is already stored needs no re-packing to be described in a manifest."""
    offsets: dict[str, int] = {}
    pos = 0
    for m in plan.members:
        pos += len(_tar_header(m.path, m.size))
        offsets[m.path] = pos
        pos += _padded(m.size)
    return offsets


def build_shard(plan: ShardPlan, read: Callable[[str], bytes]) -> tuple[bytes, ShardPlan]:
    """Pack ``plan``'s files (read with ``read(path)``) into tar bytes; returns the bytes and the
    plan with every member's SHA-256.

    A member planned with a SHA-256 is checked against it, so a file changed after it was scanned
    fails the staging instead of landing in a shard under the wrong digest; a member planned
    without one (a file not hashed yet) is hashed here, from the same read.
    """
    buf = io.BytesIO()
    members = []
    for m in plan.members:
        data = read(m.path)
        sha = hashlib.sha256(data).hexdigest()
        if len(data) != m.size or (m.sha256 and sha != m.sha256):
            raise StagingError(
                f"{m.path} changed after it was scanned (now {len(data)} bytes); stop writers and re-run staging"
            )
        members.append(Member(m.path, m.size, sha))
        buf.write(_tar_header(m.path, m.size))
        buf.write(data)
        buf.write(b"\0" * (_padded(m.size) - m.size))
    buf.write(b"\0" * (2 * _BLOCK))
    return buf.getvalue(), ShardPlan(tuple(members))


def iter_members(shard: bytes, expected: dict[str, tuple[int, int, str]]) -> Iterator[tuple[str, bytes]]:
    """Yield (path, bytes) of every expected member of ``shard``, each checked against its
    (offset, size, sha256) from the manifest."""
    view = memoryview(shard)
    for path, (offset, size, sha256) in expected.items():
        data = bytes(view[offset : offset + size])
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            raise StagingError(f"sample {path!r} in its shard is corrupt; re-run stage_data to re-copy the shard")
        yield path, data
