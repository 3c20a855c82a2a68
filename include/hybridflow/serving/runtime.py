"""Where and how the model server runs: its own Python environment (``.venv-serve``, KServe and torch,
made by scripts/bootstrap.sh; KServe's pins cannot share Airflow's environment) and the
``serving.server`` settings as its command-line flags."""

from __future__ import annotations

import os
from pathlib import Path

from hybridflow.config.pipeline import ModelServerSettings
from hybridflow.errors import DeploymentError

SERVE_PYTHON_ENV = "HYBRIDFLOW_SERVE_PYTHON"
REPO_ROOT = Path(__file__).resolve().parents[3]
SERVE_VENV = REPO_ROOT / ".venv-serve"

# serving.server setting -> the model server's flag
FLAGS = {
    "max_batch_size": "--max-batch-size",
    "max_batch_wait_ms": "--max-batch-wait-ms",
    "max_instances": "--max-instances",
    "max_body_mib": "--max-body-mib",
    "request_timeout_s": "--request-timeout-s",
}


def serve_python() -> str:
    """The interpreter that runs ``python -m hybridflow.serving.server``: ``$HYBRIDFLOW_SERVE_PYTHON``
    if set, else ``.venv-serve/bin/python`` at the repository root."""
    named = os.environ.get(SERVE_PYTHON_ENV)
    if named:
        if not os.access(named, os.X_OK):
            raise DeploymentError(f"{SERVE_PYTHON_ENV}={named} is not an executable Python; point it at the "
                                  "model server's environment or unset it to use .venv-serve")
        return named
    python = SERVE_VENV / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise DeploymentError(f"the model server's environment {SERVE_VENV} is missing; run scripts/bootstrap.sh "
                              f"(it creates .venv-serve with KServe and torch), or set {SERVE_PYTHON_ENV}")
    return str(python)


def server_args(settings: ModelServerSettings) -> list[str]:
    """The ``serving.server`` settings as the model server's flags."""
    args: list[str] = []
    for field, flag in FLAGS.items():
        args += [flag, str(getattr(settings, field))]
    return args
