#!/usr/bin/env bash
# Create (or refresh) the project's virtualenv in .venv. Idempotent: does nothing when the
# pinned requirements have not changed since the last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.bootstrap-stamp
want=$(cat requirements-dev.txt requirements-torch.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  exit 0
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
# torch first, with pip: it takes the CPU build where one is provided locally; uv would fetch CUDA.
.venv/bin/python -m pip install -q --disable-pip-version-check uv -r requirements-torch.txt
# requirements-dev.txt: what runs (requirements.txt, the same pins) plus the test and benchmark tools.
.venv/bin/uv pip install -q --python .venv/bin/python -r requirements-dev.txt
.venv/bin/uv pip install -q --python .venv/bin/python --no-deps -e .
echo "$want" > "$stamp"
echo "bootstrap: .venv ready"
