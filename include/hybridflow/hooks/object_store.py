"""Airflow hook that turns an ``aws`` Connection into an S3 object store.

The Connection holds the access key as ``login``, the secret as ``password`` and
``{"endpoint_url": ..., "region_name": ...}`` as extra (no endpoint_url means AWS itself).
Connection ids live in config/ (e.g. a cluster's ``cache.conn_id``); in dev/CI they come from
``AIRFLOW_CONN_<ID>`` (see :func:`hybridflow.devenv.rclone.airflow_conn_uri`).
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseHook

from hybridflow.errors import ConfigError
from hybridflow.storage.objectstore import StoreSpec
from hybridflow.storage.s3 import S3ObjectStore

_CONN_TYPES = ("aws", "s3")


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

    def store_spec(self, bucket: str, prefix: str = "") -> StoreSpec:
        """A :class:`StoreSpec` (with credentials) for ``bucket``/``prefix`` on this connection."""
        if not bucket:
            raise ConfigError(f"connection {self.object_store_conn_id!r}: no bucket given")
        conn = self.get_conn()
        cid = self.object_store_conn_id
        if conn.conn_type and conn.conn_type not in _CONN_TYPES:
            raise ConfigError(
                f"connection {cid!r} has type {conn.conn_type!r}; an object-store connection has type 'aws'"
            )
        if not conn.login or not conn.password:
            raise ConfigError(
                f"connection {cid!r} has no access key (login) or secret (password); "
                "set both, e.g. AIRFLOW_CONN_<ID>=aws://ACCESS:SECRET@/?endpoint_url=..."
            )
        extra = conn.extra_dejson or {}
        endpoint_url = extra.get("endpoint_url") or (extra.get("service_config") or {}).get("s3", {}).get(
            "endpoint_url"
        )
        region = extra.get("region_name") or "us-east-1"
        self.log.info(
            "object store connection %s: bucket %s prefix %r endpoint %s region %s",
            cid,
            bucket,
            prefix,
            endpoint_url or "AWS",
            region,
        )
        return StoreSpec(
            kind="s3",
            bucket=bucket,
            prefix=prefix.strip("/"),
            endpoint_url=endpoint_url or None,
            region=region,
            access_key=conn.login,
            secret_key=conn.password,
        )

    def get_store(self, bucket: str, prefix: str = "") -> S3ObjectStore:
        return S3ObjectStore.from_spec(self.store_spec(bucket, prefix))
