"""Small local files sent to an S3 store through the AWS CRT (:mod:`hybridflow.storage.crt`),
on the store's own credentials, each answer's ETag checked against the file's MD5."""

from __future__ import annotations

import os
import threading
from typing import Any

from hybridflow.storage.objectstore import NativeFilePut
from hybridflow.storage.s3_checks import ResendVerified, check_etag, clean_etag, is_md5_etag


class S3NativeUploads(NativeFilePut):
    """Mixed into :class:`~hybridflow.storage.s3.S3ObjectStore`, whose session (``client``
    resolves it), endpoint, timeouts and Content-MD5 mode it uses."""

    bucket: str
    endpoint_url: str | None
    region: str
    content_md5: bool
    crt_observers: list[Any]
    throttle: Any  # storage.bandwidth.Throttle, or None
    _crt_wanted: bool
    _crt: Any
    _boto_session: Any
    _client_lock: threading.Lock
    _connect_timeout: float
    _max_attempts: int

    def crt_putter(self):
        """The store's :class:`~hybridflow.storage.crt.CrtPutter` (created on first use), or None
        where it cannot serve: awscrt missing, switched off, no credentials, or Content-MD5 mode
        (the ETags of this store are not MD5s, so every write must be checked by the store)."""
        from hybridflow.storage.crt import crt_available

        if not self._crt_wanted or self.content_md5 or not crt_available():
            return None
        putter = self._crt
        if putter is None or putter.pid != os.getpid():
            # Outside the lock: the client property takes the same (non-reentrant) lock.
            self.client  # noqa: B018 -- resolves the session and its credentials
            with self._client_lock:
                if self._crt is None or self._crt.pid != os.getpid():
                    self._crt = self._new_putter()
                putter = self._crt
        return putter

    def _new_putter(self):
        from hybridflow.storage.crt import CrtPutter

        creds = self._boto_session.get_credentials() if self._boto_session else None
        if creds is None:
            self._crt_wanted = False
            return None

        def credentials(creds=creds) -> tuple[str, str, str | None]:
            # Asked again whenever the CRT signs: refreshable (assumed-role) credentials stay fresh.
            frozen = creds.get_frozen_credentials()
            return frozen.access_key, frozen.secret_key, frozen.token

        return CrtPutter(
            bucket=self.bucket, endpoint_url=self.endpoint_url, region=self.region, credentials=credentials,
            connect_timeout_s=self._connect_timeout, max_attempts=self._max_attempts,
        )

    def put_file_nowait(
        self, key: str, path: str, *, size: int, md5: str, sha256: str | None = None,
        metadata: dict[str, str] | None = None, done,
    ) -> bool:
        """Start PutObject of a local file through the CRT; False (nothing sent) where the store
        cannot (see :meth:`crt_putter`): use ``put_verified``. ``done(etag, error)`` is called
        once from a CRT thread; ``error`` is a ValueError when the ETag contradicts ``md5``, and
        :class:`ResendVerified` when the store's ETags turn out not to be MD5s."""
        # The CRT reads the file itself, so its bytes could not wait for a cap: capped stores send
        # through botocore.
        putter = None if self.throttle is not None else self.crt_putter()
        if putter is None:
            return False
        for observe in self.crt_observers:
            observe("PutObject", "PUT", size)

        def checked(etag: str | None, error: BaseException | None) -> None:
            if error is None:
                etag = clean_etag(etag) or ""
                if not is_md5_etag(etag):
                    self.content_md5 = True  # and from now on every write goes through botocore
                    error = ResendVerified(f"{key}: the store's ETag {etag!r} is not an MD5")
                else:
                    try:
                        etag = check_etag(etag, md5, key)
                    except ValueError as exc:
                        error = exc
            done(None if error else etag, error)

        putter.put_file(self._key(key), str(path), size=size, sha256=sha256, metadata=metadata, done=checked)
        return True
