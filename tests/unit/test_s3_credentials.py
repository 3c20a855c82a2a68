"""Where an S3 store's credentials come from: an ``aws`` Connection read by the Amazon provider's
AwsBaseHook (keys, a role to assume, the default chain), against a real ``rclone serve s3`` and a
local STS endpoint, both on loopback."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

import pytest

from hybridflow.devenv.rclone import airflow_conn_uri
from hybridflow.errors import ConfigError
from hybridflow.hooks.object_store import ObjectStoreHook
from hybridflow.storage.objectstore import SESSION_TOKEN_ENV, StoreSpec, open_store
from hybridflow.storage.s3 import S3ObjectStore

pytestmark = pytest.mark.s3

ROLE = "arn:aws:iam::123456789012:role/hf-cache-writer"
BASE_ACCESS, BASE_SECRET = "hf-base-user-access", "hf-base-user-secret-0123"  # unknown to rclone


@pytest.fixture(autouse=True)
def no_ambient_aws(monkeypatch, tmp_path):
    """Only what a test sets: no credentials, profile or instance metadata from the machine."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                 "AWS_ENDPOINT_URL_STS", "AWS_DEFAULT_REGION", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", "")


def _set_conn(monkeypatch, conn_id: str, conn: dict | str) -> ObjectStoreHook:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", conn if isinstance(conn, str) else json.dumps(conn))
    return ObjectStoreHook(object_store_conn_id=conn_id)


def _bucket() -> str:
    return f"hf-cred-{uuid.uuid4().hex[:10]}"


def _security_tokens(store: S3ObjectStore) -> list[str | None]:
    seen: list[str | None] = []

    def record(request, **kwargs) -> None:
        token = request.headers.get("X-Amz-Security-Token")
        seen.append(token.decode() if isinstance(token, bytes) else token)

    store.client.meta.events.register("before-send.s3", record)
    return seen


class StsEndpoint:
    """A local STS that answers AssumeRole with the keys it was given and records each call."""

    def __init__(self, access: str, secret: str, *, lifetime: timedelta = timedelta(hours=1),
                 refuse: bool = False) -> None:
        self.calls: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 -- http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
                form = {k: v[0] for k, v in parse_qs(body).items()}
                form["authorization"] = self.headers.get("Authorization", "")
                outer.calls.append(form)
                if refuse:
                    self._answer(403, (
                        '<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error><Type>Sender</Type>'
                        "<Code>AccessDenied</Code><Message>not authorized to perform sts:AssumeRole</Message>"
                        "</Error><RequestId>1</RequestId></ErrorResponse>"
                    ))
                    return
                token = f"hf-session-token-{len(outer.calls)}"
                expires = (datetime.now(UTC) + lifetime).strftime("%Y-%m-%dT%H:%M:%SZ")
                self._answer(200, (
                    '<AssumeRoleResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><AssumeRoleResult>'
                    f"<Credentials><AccessKeyId>{access}</AccessKeyId><SecretAccessKey>{secret}</SecretAccessKey>"
                    f"<SessionToken>{token}</SessionToken><Expiration>{expires}</Expiration></Credentials>"
                    f"<AssumedRoleUser><AssumedRoleId>AROAEXAMPLE:{form.get('RoleSessionName', '')}</AssumedRoleId>"
                    f"<Arn>{form.get('RoleArn', '')}/session</Arn></AssumedRoleUser>"
                    "</AssumeRoleResult><ResponseMetadata><RequestId>1</RequestId></ResponseMetadata>"
                    "</AssumeRoleResponse>"
                ))

            def _answer(self, status: int, xml: str) -> None:
                body = xml.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    def __enter__(self) -> StsEndpoint:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


# -- keys in the Connection ----------------------------------------------------------------------


def test_keys_from_the_connection_reach_the_endpoint_it_names(rclone_s3, monkeypatch):
    endpoint, access, secret, data_dir = rclone_s3
    hook = _set_conn(monkeypatch, "hf_cred_keys", airflow_conn_uri(access, secret, endpoint))
    store = hook.get_store(_bucket(), "team")
    assert store.client.meta.endpoint_url == endpoint
    store.ensure_bucket()
    store.put_bytes("k", b"by keys")
    assert (data_dir / store.bucket / "team" / "k").read_bytes() == b"by keys"
    spec = store.spec
    assert spec.credential_env() == {"HYBRIDFLOW_STORE_ACCESS_KEY": access, "HYBRIDFLOW_STORE_SECRET_KEY": secret}


def test_the_s3_service_endpoint_of_service_config_is_honoured(rclone_s3, monkeypatch):
    endpoint, access, secret, data_dir = rclone_s3
    hook = _set_conn(monkeypatch, "hf_cred_svc", {
        "conn_type": "aws", "login": access, "password": secret,
        "extra": {"endpoint_url": "http://127.0.0.1:9", "service_config": {"s3": {"endpoint_url": endpoint}}},
    })
    store = hook.get_store(_bucket())
    assert store.endpoint_url == endpoint  # the per-service endpoint wins over the global one
    store.ensure_bucket()
    store.put_bytes("k", b"v")
    assert (data_dir / store.bucket / "k").read_bytes() == b"v"


def test_an_access_key_without_its_secret_is_refused_by_name(monkeypatch):
    hook = _set_conn(monkeypatch, "hf_cred_half", {"conn_type": "aws", "login": "onlyaccesskey12"})
    with pytest.raises(ConfigError, match="hf_cred_half.*not both"):
        hook.store_spec("b")


def test_credentials_stay_out_of_logs_specs_and_errors(rclone_s3, monkeypatch, caplog, capfd):
    endpoint, access, _, _ = rclone_s3
    secret = "hf-wrong-secret-never-logged"
    hook = _set_conn(monkeypatch, "hf_cred_log", airflow_conn_uri(access, secret, endpoint))
    with caplog.at_level(logging.DEBUG):
        store = hook.get_store(_bucket())
        with pytest.raises(Exception) as refused:  # noqa: PT011 -- any refusal; its text is what matters
            store.ensure_bucket()
    assert "SignatureDoesNotMatch" in str(refused.value) or "403" in str(refused.value)
    spec = store.spec
    out, err = capfd.readouterr()  # the hook logs through structlog, botocore through logging
    logged = caplog.text + out + err
    assert "access key from the connection" in logged and "Authorization" in logged  # both were heard
    for text in (logged, str(refused.value), repr(store), repr(spec), json.dumps(spec.to_dict())):
        assert secret not in text


# -- the default chain ---------------------------------------------------------------------------


def test_a_connection_without_keys_uses_the_default_chain(rclone_s3, monkeypatch):
    endpoint, access, secret, data_dir = rclone_s3
    hook = _set_conn(monkeypatch, "hf_cred_chain", {"conn_type": "aws", "extra": {"endpoint_url": endpoint}})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    spec = hook.store_spec(_bucket(), "chain")
    assert spec.access_key is None and spec.credential_env() == {}  # a child resolves its own chain
    store = S3ObjectStore.from_spec(spec)
    store.ensure_bucket()
    store.put_bytes("k", b"from the environment")
    assert store._boto_session.get_credentials().method == "env"
    # A worker given only the serialised spec finds the same chain in its environment.
    worker = open_store(StoreSpec.from_dict(spec.to_dict(), environ={}))
    assert worker.get_bytes("k") == b"from the environment"
    assert (data_dir / store.bucket / "chain" / "k").is_file()


def test_the_default_chain_is_really_consulted(rclone_s3, monkeypatch):
    endpoint, access, _, _ = rclone_s3
    hook = _set_conn(monkeypatch, "hf_cred_chain_bad", {"conn_type": "aws", "extra": {"endpoint_url": endpoint}})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-rclone-secret")
    with pytest.raises(Exception, match="(?i)signature|forbidden|403"):
        hook.get_store(_bucket()).ensure_bucket()


# -- a role to assume ----------------------------------------------------------------------------


def _role_conn(endpoint: str, sts_url: str, **extra) -> dict:
    return {
        "conn_type": "aws", "login": BASE_ACCESS, "password": BASE_SECRET,
        "extra": {"endpoint_url": endpoint, "role_arn": ROLE, "service_config": {"sts": {"endpoint_url": sts_url}},
                  **extra},
    }


def test_a_role_connection_assumes_the_role_and_signs_with_its_keys(rclone_s3, monkeypatch):
    endpoint, access, secret, data_dir = rclone_s3
    with StsEndpoint(access, secret) as sts:
        hook = _set_conn(monkeypatch, "hf_cred_role", _role_conn(endpoint, sts.url))
        spec = hook.store_spec(_bucket())
        store = S3ObjectStore.from_spec(spec)
        tokens = _security_tokens(store)
        store.ensure_bucket()
        store.put_bytes("k", b"as the role")
    assert (data_dir / store.bucket / "k").read_bytes() == b"as the role"
    assert sts.calls and {c["Action"] for c in sts.calls} == {"AssumeRole"}
    assert {c["RoleArn"] for c in sts.calls} == {ROLE}
    assert all(f"Credential={BASE_ACCESS}/" in c["authorization"] for c in sts.calls)  # signed by the base keys
    assert tokens and all(t and t.startswith("hf-session-token-") for t in tokens)
    # Children get the role's temporary keys, token included, and reach the store with them.
    env = spec.credential_env()
    assert env["HYBRIDFLOW_STORE_ACCESS_KEY"] == access and env[SESSION_TOKEN_ENV].startswith("hf-session-token-")
    assert BASE_SECRET not in json.dumps(env)
    worker = open_store(StoreSpec.from_dict(spec.to_dict(), environ=env))
    assert worker.get_bytes("k") == b"as the role"


def test_without_the_role_the_same_base_keys_are_refused(rclone_s3, monkeypatch):
    """The role test above passes only because the role was assumed: the base keys alone fail."""
    endpoint, _, _, _ = rclone_s3
    conn = _role_conn(endpoint, "http://127.0.0.1:9")
    del conn["extra"]["role_arn"]
    hook = _set_conn(monkeypatch, "hf_cred_norole", conn)
    with pytest.raises(Exception, match="(?i)invalidaccesskeyid|forbidden|403|access key"):
        hook.get_store(_bucket()).ensure_bucket()


def test_assumed_role_credentials_are_refreshed_as_they_expire(rclone_s3, monkeypatch):
    endpoint, access, secret, _ = rclone_s3
    # Five minutes left is inside botocore's mandatory refresh window: every signing refreshes.
    with StsEndpoint(access, secret, lifetime=timedelta(minutes=5)) as sts:
        hook = _set_conn(monkeypatch, "hf_cred_refresh", _role_conn(endpoint, sts.url))
        store = hook.get_store(_bucket())
        tokens = _security_tokens(store)
        store.ensure_bucket()
        store.put_bytes("a", b"1")
        store.put_bytes("b", b"2")
    assert len(set(tokens)) >= 2  # later requests signed with newer session tokens
    assert len(sts.calls) >= 3


def test_role_session_options_of_the_connection_reach_sts(rclone_s3, monkeypatch):
    endpoint, access, secret, _ = rclone_s3
    with StsEndpoint(access, secret) as sts:
        hook = _set_conn(monkeypatch, "hf_cred_kwargs", _role_conn(
            endpoint, sts.url, assume_role_kwargs={"RoleSessionName": "hf-stage", "DurationSeconds": 7200}
        ))
        hook.get_store(_bucket()).ensure_bucket()
    assert sts.calls[0]["RoleSessionName"] == "hf-stage" and sts.calls[0]["DurationSeconds"] == "7200"


def test_a_refused_assume_role_names_the_connection_and_the_role(rclone_s3, monkeypatch):
    endpoint, access, secret, _ = rclone_s3
    with StsEndpoint(access, secret, refuse=True) as sts:
        hook = _set_conn(monkeypatch, "hf_cred_denied", _role_conn(endpoint, sts.url))
        with pytest.raises(ConfigError, match=f"hf_cred_denied.*{ROLE}.*AccessDenied.*trust policy") as failed:
            hook.store_spec(_bucket())
    assert len(sts.calls) == 1  # refused, not retried
    assert BASE_SECRET not in str(failed.value)
