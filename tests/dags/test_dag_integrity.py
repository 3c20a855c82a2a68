"""House rules for every DAG file: parses cleanly and fast, looks nothing up, and every task is
owned, retried and tagged. One test per file so a failure names the file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.airflow

DAGS = Path(__file__).resolve().parents[2] / "dags"
DAG_FILES = sorted(p for p in DAGS.glob("*.py") if not p.name.startswith("_"))

# Parsed in a fresh interpreter: Airflow's own import is warmed first and not counted, then the
# file is imported with connection and Variable look-ups counted and heavy libraries watched.
PROBE = r"""
import importlib.util, json, sys, time
import airflow.sdk
from airflow.sdk import BaseHook, Variable
from airflow.sdk.definitions.connection import Connection

lookups = []
def _count(kind):
    def _look(*args, **kwargs):
        lookups.append(kind)
        raise RuntimeError(f"{kind} look-up while parsing")
    return _look
BaseHook.get_connection = classmethod(_count("connection"))
Connection.get = classmethod(_count("connection"))
Variable.get = staticmethod(_count("variable"))

path = sys.argv[1]
before = set(sys.modules)
t0 = time.perf_counter()
spec = importlib.util.spec_from_file_location("dag_under_test", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
seconds = time.perf_counter() - t0
heavy = sorted(m for m in ("torch", "pandas", "great_expectations", "boto3", "sklearn", "numpy")
               if m in sys.modules and m not in before)
print(json.dumps({"seconds": seconds, "lookups": lookups, "heavy": heavy}))
"""


def _probe(path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, f"{path.name} failed to import:\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def test_there_are_dag_files():
    assert DAG_FILES, "no DAG files found"


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_parses_fast_with_no_lookups_and_no_heavy_imports(path: Path):
    result = _probe(path)
    assert result["lookups"] == [], f"{path.name} looked up {result['lookups']} while parsing"
    assert result["heavy"] == [], f"{path.name} imports {result['heavy']} at parse time; import inside tasks"
    assert result["seconds"] < 0.5, f"{path.name} took {result['seconds']:.2f}s to parse"


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_no_import_errors(dagbag, path: Path):
    errors = {Path(k).name: v for k, v in dagbag.import_errors.items()}
    assert path.name not in errors, errors.get(path.name)


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_house_rules(dagbag, path: Path):
    dags = [d for d in dagbag.dags.values() if Path(d.fileloc).name == path.name]
    assert dags, f"{path.name} defines no DAG"
    for dag in dags:
        assert dag.tags, f"{dag.dag_id} has no tags"
        assert dag.doc_md, f"{dag.dag_id} has no doc_md"
        for t in dag.tasks:
            assert t.owner and t.owner != "airflow", f"{dag.dag_id}.{t.task_id} has no owner"
            assert t.retries is not None, f"{dag.dag_id}.{t.task_id} has no retries set"
        for name in dag.params:
            param = dag.params.get_param(name)
            assert param.schema.get("title") and param.description, f"{dag.dag_id} Param {name} is undocumented"
