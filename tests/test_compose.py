"""docker-compose.yaml and the Dockerfile agree with the code: every service the docs name exists and
starts in order, every connection id the estate uses is set from .env (never a literal secret), every
cache bucket is created, and every command a container runs is one the installed CLIs accept.
Docker itself cannot run here; these checks are what can be known without it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridflow.config import load_estate

REPO = Path(__file__).resolve().parents[1]
AIRFLOW_SERVICES = (
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
    "airflow-worker",
)
LONG_RUNNING = ("postgres", "redis", "minio", *AIRFLOW_SERVICES)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yaml").read_text())


@pytest.fixture(scope="module")
def estate():
    return load_estate(REPO / "config", use_cache=False)


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    return env if isinstance(env, dict) else dict(item.split("=", 1) for item in env)


def test_every_service_exists_with_a_health_check_and_ordered_start(compose):
    services = compose["services"]
    for name in (*LONG_RUNNING, "minio-init", "airflow-init"):
        assert name in services, f"docker-compose.yaml has no service {name}"
    for name in LONG_RUNNING:
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert cond["condition"] in ("service_healthy", "service_completed_successfully")
    for name in AIRFLOW_SERVICES:
        deps = services[name]["depends_on"]
        assert deps["airflow-init"]["condition"] == "service_completed_successfully", name
        assert deps["postgres"]["condition"] == "service_healthy", name
    assert services["airflow-worker"]["depends_on"]["airflow-apiserver"]["condition"] == "service_healthy"


def test_airflow_services_share_one_image_config_and_storage(compose):
    services = compose["services"]
    for name in (*AIRFLOW_SERVICES, "airflow-init"):
        svc = services[name]
        assert svc["build"] == "." and svc["image"] == "hybridflow-airflow:0.1.0", name
        assert "./config:/opt/hybridflow/config:ro" in svc["volumes"], name
        assert "hybridflow-var:/opt/hybridflow/var" in svc["volumes"], name
        env = _env(svc)
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
        assert env["HYBRIDFLOW_CONFIG_DIR"] == "/opt/hybridflow/config"
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"].startswith("http://airflow-apiserver:8080/")


def test_every_cache_connection_is_set_and_every_bucket_created(compose, estate):
    env = _env(compose["services"]["airflow-worker"])
    init = " ".join(compose["services"]["minio-init"]["command"])
    caches = [c.cache for c in estate.clusters.values() if c.cache is not None]
    assert caches, "the shipped estate has no public cluster cache"
    from airflow.sdk.definitions.connection import Connection

    for cache in caches:
        key = f"AIRFLOW_CONN_{cache.conn_id.upper()}"
        assert key in env, f"{key} (config/clusters.yaml cache.conn_id) is not set in docker-compose.yaml"
        uri = re.sub(r"\$\{(\w+)[^}]*\}", lambda m: f"{m.group(1).lower()}value", env[key])
        conn = Connection.from_uri(uri, conn_id=cache.conn_id)
        assert conn.conn_type == "aws" and conn.login == "minio_access_keyvalue"
        assert conn.extra_dejson["endpoint_url"] == "http://minio:9000"
        assert f"cache/{cache.bucket}" in init, f"minio-init does not create bucket {cache.bucket}"


SECRETISH = re.compile(r"(PASSWORD$|SECRET$|_KEY$|AIRFLOW_CONN_|SQL_ALCHEMY_CONN|RESULT_BACKEND)")


def test_no_secret_is_written_in_the_file(compose):
    for name, svc in compose["services"].items():
        for key, value in _env(svc).items():
            if SECRETISH.search(key):
                creds = re.sub(r"\$\{[^}]+\}", "", str(value))
                # What is left once substitutions are removed must carry no credential.
                assert not re.search(r"://[^@/]*:[^@/]+@", creds), f"{name}.{key} has a literal credential"
                if "://" not in str(value):
                    assert str(value).startswith("${"), f"{name}.{key} is a literal secret"


def test_dockerfile_installs_the_pinned_requirements_and_the_package():
    text = (REPO / "Dockerfile").read_text()
    assert "COPY requirements.txt requirements-torch.txt" in text
    assert "-r requirements-torch.txt" in text and "-r requirements.txt" in text
    assert re.search(r"pip install --no-deps \.", text)
    for folder in ("dags", "plugins", "config", "include", "examples"):
        assert f"COPY {folder} " in text, folder
    pins = (REPO / "requirements.txt").read_text()
    # The executor the compose file uses must be installed by requirements.txt.
    assert re.search(r"^apache-airflow-providers-celery==", pins, re.M)
    assert re.search(r"^psycopg2-binary==", pins, re.M) and re.search(r"^redis==", pins, re.M)


PARSE = r"""
import json, os, sys
os.environ["AIRFLOW__CORE__EXECUTOR"] = "CeleryExecutor"
from airflow.cli.cli_parser import get_parser
bad = []
for argv in json.loads(sys.argv[1]):
    try:
        get_parser().parse_args(argv)
    except SystemExit as exc:
        bad.append([argv, str(exc)])
print(json.dumps(bad))
"""


def test_every_container_command_is_accepted_by_the_installed_clis(compose):
    services = compose["services"]
    argvs = [services[n]["command"].split() for n in AIRFLOW_SERVICES]
    argvs += [["db", "migrate"], ["jobs", "check", "--job-type", "TriggererJob", "--hostname", "h"]]
    argvs += [["jobs", "check", "--job-type", "DagProcessorJob", "--hostname", "h"]]
    out = subprocess.run(
        [sys.executable, "-c", PARSE, json.dumps(argvs)], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    assert services["airflow-init"]["command"] == ["airflow db migrate && hybridflow seed"]
    from hybridflow.cli import main

    with pytest.raises(SystemExit) as info:
        main(["seed", "--help"])
    assert info.value.code == 0


def test_every_database_url_has_its_driver_installed(compose):
    # A URL without a driver picks SQLAlchemy's default one for the dialect, which may not be in the
    # image (db+postgresql:// needs psycopg 3, the image has psycopg2): the service would not start.
    from sqlalchemy.engine import make_url

    env = _env(compose["x-airflow-common"])
    urls = {k: v for k, v in env.items() if k.endswith(("SQL_ALCHEMY_CONN", "RESULT_BACKEND"))}
    assert set(urls) == {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CELERY__RESULT_BACKEND"}
    for key, value in urls.items():
        url = make_url(re.sub(r"\$\{[^}]*\}", "x", value.removeprefix("db+")))
        url.get_dialect().import_dbapi()  # raises ImportError when the driver is missing
        assert url.drivername == "postgresql+psycopg2", key
