"""Request bodies botocore can rewind on retry, over memory or over an item's reads."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable

from hybridflow.storage.transfer_types import UploadItem

_MiB = 1024 * 1024


class ViewReader(io.RawIOBase):
    """A seekable file over a memoryview: a request body botocore can re-read on retry without the
    part being copied into a new bytes object first."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), len(self._view) - self._pos)
        b[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        out = bytes(self._view[self._pos : end])
        self._pos = end
        return out

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def getbuffer(self) -> memoryview:
        return self._view

    def __len__(self) -> int:
        return len(self._view)


class RangeReader(io.RawIOBase):
    """One object of an :class:`UploadItem` as a seekable raw file (botocore rewinds it on retry);
    wrapped in a large io.BufferedReader, the source is read in a few big ranges while the HTTP
    layer takes its small blocks from the buffer. ``on_read`` hears of bytes read for the first
    time (a retry re-reads from the start without counting twice)."""

    def __init__(self, item: UploadItem, on_read: Callable[[int], None]) -> None:
        super().__init__()
        self._item, self._pos, self._high, self._on_read = item, 0, 0, on_read

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self._item.size - self._pos)
        if n <= 0:
            return 0
        view = memoryview(b)[:n]
        if self._item.readinto is not None:
            got = self._item.readinto(self._pos, view)
        else:
            data = self._item.read(self._pos, n)
            got = len(data)
            view[:got] = data
        if got <= 0:
            raise ValueError(f"{self._item.label or self._item.key}: short read at byte {self._pos}")
        self._pos += got
        if self._pos > self._high:
            self._on_read(self._pos - self._high)
            self._high = self._pos
        return got

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._item.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


STREAM_BUFFER = 8 * _MiB  # read-ahead of a streamed whole-object body


def md5_of(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()
