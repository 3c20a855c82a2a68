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

import functools
import hashlib
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hybridflow.errors import StagingError

_BLOCK = 512
_ZEROS = bytes(2 * _BLOCK)
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

    @functools.cached_property  # asked for several times per shard while staging
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
        return sum(_header_len(m.path, m.size) + _padded(m.size) for m in self.members) + 2 * _BLOCK

    @property
    def max_bytes(self) -> int:
        """Upper bound of the packed size (headers, long-name records, padding, end blocks): a
        member's headers take at most 3 blocks, its path and a few bytes of PAX record; the 4th
        block also leaves room for the byte past each file that :func:`build_shard` reads."""
        return sum(4 * _BLOCK + len(m.path.encode()) + _padded(m.size) for m in self.members) + 2 * _BLOCK


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


def _tarfile_header(path: str, size: int) -> bytes:
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


def _fits_ustar(path: str, size: int) -> bool:
    # tarfile's own rule for needing no PAX records here: an ASCII name of at most 100
    # characters, a size below 8 GiB (the other fields are fixed).
    return path.isascii() and len(path) <= 100 and size < 8**11


@functools.cache
def _ustar_template() -> bytes:
    return _tarfile_header("", 0)


def _tar_header(path: str, size: int) -> bytes:
    if not _fits_ustar(path, size):
        return _tarfile_header(path, size)
    # tarfile's block for ("", 0) with the name, size and checksum fields filled in: the same
    # bytes tobuf() gives, at a tenth of its cost (tobuf was most of packing's Python time).
    header = bytearray(_ustar_template())
    header[0 : len(path)] = path.encode("ascii")
    header[124:136] = b"%011o\0" % size
    header[148:156] = b"        "  # the checksum is taken with its own field as spaces
    header[148:155] = b"%06o\0" % sum(header)
    return bytes(header)


def _header_len(path: str, size: int) -> int:
    # Saves building 10,000s of headers to learn only their lengths.
    return _BLOCK if _fits_ustar(path, size) else len(_tarfile_header(path, size))


def shard_offsets(plan: ShardPlan) -> dict[str, int]:
    """Where each member's bytes start in the packed shard; a function of the plan alone, so a
    shard that is already stored needs no re-packing to be described in a manifest."""
    offsets: dict[str, int] = {}
    pos = 0
    for m in plan.members:
        pos += _header_len(m.path, m.size)
        offsets[m.path] = pos
        pos += _padded(m.size)
    return offsets


def build_shard(
    plan: ShardPlan, buf: bytearray, *, read: Callable[[str], bytes],
    readinto: Callable[[str, memoryview], int] | None = None,
) -> tuple[memoryview, ShardPlan]:
    """Pack ``plan``'s files into ``buf``; returns a view of the tar bytes in it and the plan with
    every member's SHA-256. Files are read straight into place with ``readinto(path, view)``
    (returns the bytes read) where the source offers it, else with ``read(path)``.

    The caller reuses ``buf`` from shard to shard: faulting in fresh memory for every file read
    and every growing shard cost more CPU than the reads themselves. A ``buf`` shorter than
    :attr:`ShardPlan.max_bytes` is replaced by a new one.

    A member planned with a SHA-256 is checked against it, so a file changed after it was scanned
    fails the staging instead of landing in a shard under the wrong digest; a member planned
    without one (a file not hashed yet) is hashed here, from the same read.
    """
    if len(buf) < plan.max_bytes:
        buf = bytearray(plan.max_bytes)
    view = memoryview(buf)
    pos = 0
    members = []
    for m in plan.members:
        header = _tar_header(m.path, m.size)
        view[pos : pos + len(header)] = header
        pos += len(header)
        # One byte more than planned: a file that grew since the scan is caught. It lands in room
        # that padding or the next header overwrites (max_bytes leaves at least a block per member).
        slot = view[pos : pos + m.size + 1]
        if readinto is not None:
            got = readinto(m.path, slot)
        else:
            data = read(m.path)
            got = len(data)
            if got == m.size:
                slot[:got] = data
        sha = hashlib.sha256(view[pos : pos + m.size]).hexdigest() if got == m.size else ""
        if got != m.size or (m.sha256 and sha != m.sha256):
            what = f"its size is no longer {m.size} bytes" if got != m.size else "its SHA-256 differs"
            raise StagingError(f"{m.path} changed after it was scanned ({what}); stop writers and re-run staging")
        members.append(Member(m.path, m.size, sha))
        pad = _padded(m.size) - m.size
        view[pos + m.size : pos + m.size + pad] = _ZEROS[:pad]
        pos += m.size + pad
    view[pos : pos + 2 * _BLOCK] = _ZEROS
    pos += 2 * _BLOCK
    return view[:pos], ShardPlan(tuple(members))


def iter_members(shard: bytes, expected: dict[str, tuple[int, int, str]]) -> Iterator[tuple[str, bytes]]:
    """Yield (path, bytes) of every expected member of ``shard``, each checked against its
    (offset, size, sha256) from the manifest."""
    view = memoryview(shard)
    for path, (offset, size, sha256) in expected.items():
        data = bytes(view[offset : offset + size])
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            raise StagingError(f"sample {path!r} in its shard is corrupt; re-run stage_data to re-copy the shard")
        yield path, data
