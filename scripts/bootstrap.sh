#!/usr/bin/env bash
# Create (or refresh) the project's virtualenvs: .venv (Airflow, the pipeline, the tests) and .venv-serve
# (the model server: KServe's ModelServer, whose pins cannot share Airflow's environment). Idempotent:
# each does nothing when its pinned requirements have not changed since its last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

stamp=.venv/.bootstrap-stamp
want=$(cat requirements-dev.txt requirements-torch.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  [[ -x .venv/bin/python ]] || "$PY" -m venv .venv
  # torch through uv: PyPI's build (with its CUDA libraries, several GB) is downloaded once into uv's
  # cache and linked from there into both virtualenvs, never fetched twice.
  .venv/bin/python -m pip install -q --disable-pip-version-check uv
  .venv/bin/uv pip install -q --python .venv/bin/python -r requirements-torch.txt
  # requirements-dev.txt: what runs (requirements.txt, the same pins) plus the test and benchmark tools.
  .venv/bin/uv pip install -q --python .venv/bin/python -r requirements-dev.txt
  .venv/bin/uv pip install -q --python .venv/bin/python --no-deps -e .
  echo "$want" > "$stamp"
  echo "bootstrap: .venv ready"
fi

# The model server's environment (hybridflow.serving.runtime.serve_python()): torch the same way, then
# KServe and what the server imports; the project itself without dependencies, so the server and the
# example model packages its bundles name import from this checkout.
serve_stamp=.venv-serve/.bootstrap-stamp
serve_want=$(cat requirements-serve.txt requirements-torch.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [[ ! -f $serve_stamp || $(cat "$serve_stamp") != "$serve_want" ]]; then
  [[ -x .venv-serve/bin/python ]] || "$PY" -m venv .venv-serve
  .venv/bin/uv pip install -q --python .venv-serve/bin/python -r requirements-torch.txt
  .venv/bin/uv pip install -q --python .venv-serve/bin/python -r requirements-serve.txt
  .venv/bin/uv pip install -q --python .venv-serve/bin/python --no-deps -e .
  echo "$serve_want" > "$serve_stamp"
  echo "bootstrap: .venv-serve ready"
fi
