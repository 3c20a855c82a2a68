"""Airflow hook that turns an ``aws`` Connection into an S3 object store.

The Connection is read by the Amazon provider's ``AwsBaseHook``, so it takes what that
provider's ``aws`` Connection takes: access keys (``login``/``password``, or the
``aws_access_key_id``/``aws_secret_access_key``/``aws_session_token`` extras), a role to assume
(``role_arn``, ``assume_role_method``, ``assume_role_kwargs``), or nothing at all: boto3's
default chain (environment, instance profile, IRSA/web identity). ``endpoint_url`` (or
``service_config: {"s3": {"endpoint_url": ...}}``) points it at an S3-compatible store;
``region_name`` defaults to us-east-1. Connection ids live in config/ (e.g. a cluster's
``cache.conn_id``); in dev/CI they come from ``AIRFLOW_CONN_<ID>`` (see
:func:`hybridflow.devenv.rclone.airflow_conn_uri`). docs/storage.md has examples.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from airflow.sdk import BaseHook

from hybridflow.errors import ConfigError
from hybridflow.storage.objectstore import StoreSpec
from hybridflow.storage.s3 import S3ObjectStore
from hybridflow.storage.s3_session import frozen_credentials

_CONN_TYPES = ("aws", "s3")
DEFAULT_REGION = "us-east-1"


class ObjectStoreHook(BaseHook):
    conn_name_attr = "object_store_conn_id"
    default_conn_name = "hybridflow_object_store"
    conn_type = "aws"
    hook_name = "HybridFlow S3-compatible object store"

    def __init__(self, object_store_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Only remember the id: the Connection is resolved when a method runs (inside the task),
        # never at DAG-parse time.
        self.object_store_conn_id = object_store_conn_id

    def get_conn(self):
        """The Airflow Connection this hook reads."""
        return self.get_connection(self.object_store_conn_id)

    @cached_property
    def aws_hook(self):
        """The Amazon provider's hook on the same Connection: it owns the credentials."""
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

        return AwsBaseHook(aws_conn_id=self.object_store_conn_id, client_type="s3")

    def _checked_conn(self):
        conn = self.get_conn()
        cid = self.object_store_conn_id
        if conn.conn_type and conn.conn_type not in _CONN_TYPES:
            raise ConfigError(
                f"connection {cid!r} has type {conn.conn_type!r}; an object-store connection has type 'aws'"
            )
        if bool(conn.login) != bool(conn.password):
            raise ConfigError(
                f"connection {cid!r} has an access key (login) or a secret (password) but not both; set both, "
                "e.g. AIRFLOW_CONN_<ID>=aws://ACCESS:SECRET@/?endpoint_url=..., or neither to use a role "
                "or the default credential chain"
            )
        return conn

    def store_spec(self, bucket: str, prefix: str = "") -> StoreSpec:
        """A :class:`StoreSpec` for ``bucket``/``prefix`` on this connection.

        In this process the store signs with the provider's session (an assumed role is refreshed
        as it expires). Child processes get keys through :meth:`StoreSpec.credential_env`: the
        Connection's own, or the assumed role's temporary ones (valid for the role's session
        duration); with the default chain they get none and resolve their own chain.
        """
        if not bucket:
            raise ConfigError(f"connection {self.object_store_conn_id!r}: no bucket given")
        self._checked_conn()
        config = self.aws_hook.conn_config
        endpoint_url = config.get_service_endpoint_url("s3")
        region = config.region_name or DEFAULT_REGION

        def session():
            return self.aws_hook.get_session(region_name=region)

        keys, source = None, "default credential chain"
        if config.role_arn:
            keys, source = self._assumed(session, config.role_arn), f"role {config.role_arn}"
        elif config.aws_access_key_id:
            keys = (config.aws_access_key_id, config.aws_secret_access_key, config.aws_session_token)
            source = "access key from the connection"
        self.log.info(
            "object store connection %s: bucket %s prefix %r endpoint %s region %s, credentials: %s",
            self.object_store_conn_id, bucket, prefix, endpoint_url or "AWS", region, source,
        )
        access, secret, token = keys or (None, None, None)
        return StoreSpec(
            kind="s3",
            bucket=bucket,
            prefix=prefix.strip("/"),
            endpoint_url=endpoint_url or None,
            region=region,
            access_key=access,
            secret_key=secret,
            session_token=token,
            session=session,
        )

    def _assumed(self, session, role_arn: str) -> tuple[str, str, str | None] | None:
        """The role's temporary keys (one AssumeRole), for child processes."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return frozen_credentials(session())
        except (BotoCoreError, ClientError) as exc:
            raise ConfigError(
                f"connection {self.object_store_conn_id!r}: assuming role {role_arn} failed ({exc}); check "
                "role_arn, the credentials it is assumed with (the connection's keys or the default chain) "
                "and the role's trust policy"
            ) from exc

    def get_store(self, bucket: str, prefix: str = "") -> S3ObjectStore:
        return S3ObjectStore.from_spec(self.store_spec(bucket, prefix))
