"""Credentials and the botocore client of an S3 store.

Credentials come from one of three places: explicit keys (a worker's environment, see
:meth:`~hybridflow.storage.objectstore.StoreSpec.credential_env`), a session factory (the Amazon
provider's ``AwsBaseHook`` behind an Airflow Connection: keys, an assumed role, web identity), or
boto3's default chain. Whatever the source, the client gets this module's timeouts, retries,
path-style addressing and checksum mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SessionFactory = Callable[[], Any]


@dataclass(frozen=True)
class ClientSettings:
    region: str = "us-east-1"
    connect_timeout: float = 5.0
    read_timeout: float = 60.0
    max_attempts: int = 5
    checksums: str = "when_required"  # or "when_supported" (see storage.s3)
    max_pool_connections: int = 32


def fast_timestamp(value: str):
    """ISO-8601 timestamps (every LastModified in a listing) without dateutil, which costs ~40 us
    each and dominated the CPU of listing 100k objects; other forms go to botocore's parser."""
    from datetime import datetime

    try:
        return datetime.fromisoformat(value)
    except (TypeError, ValueError):
        from botocore.utils import parse_timestamp

        return parse_timestamp(value)


def keys_session(
    access_key: str | None, secret_key: str | None, session_token: str | None, region: str
):
    """A boto3 Session on these keys, or on the default chain where ``access_key`` is None."""
    import boto3
    import botocore.session

    return boto3.session.Session(
        aws_access_key_id=access_key or None,
        aws_secret_access_key=secret_key if access_key else None,
        aws_session_token=session_token if access_key else None,
        region_name=region,
        botocore_session=botocore.session.get_session(),
    )


def make_client(session, endpoint_url: str | None, settings: ClientSettings):
    """An S3 client of ``session`` configured for this package's transfers."""
    from botocore.config import Config
    from botocore.handlers import add_expect_header

    config = Config(
        region_name=settings.region,
        connect_timeout=settings.connect_timeout,
        read_timeout=settings.read_timeout,
        retries={"max_attempts": settings.max_attempts, "mode": "standard"},
        # Path-style: rclone/MinIO on an IP:port cannot serve virtual-host buckets. No SigV4
        # payload hash: every PUT carries a checksum header instead, and over plain HTTP botocore
        # would otherwise SHA-256 every byte a second time.
        s3={"addressing_style": "path", "payload_signing_enabled": False},
        request_checksum_calculation=settings.checksums,
        response_checksum_validation=settings.checksums,
        max_pool_connections=settings.max_pool_connections,
    )
    # boto3 keeps its botocore session private; the parser default must be set before the
    # client exists. Each session here is new, so no other client is affected.
    core = session._session  # noqa: SLF001
    core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=fast_timestamp)
    client = session.client("s3", endpoint_url=endpoint_url, config=config)
    # No "Expect: 100-continue" on PUTs: it costs a round trip per request (most of the time of
    # a small object on a fast link) to save a body that an error answer would discard.
    client.meta.events.unregister("before-call.s3", add_expect_header)
    return client


def frozen_credentials(session) -> tuple[str, str, str | None] | None:
    """(access key, secret key, token) the session signs with now, or None without any."""
    creds = session.get_credentials()
    if creds is None:
        return None
    frozen = creds.get_frozen_credentials()
    return frozen.access_key, frozen.secret_key, frozen.token
