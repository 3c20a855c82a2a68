"""The layout docs/architecture.md describes is the layout the code has: its dependency map, the
rules on top of it, and the size limits with their listed exceptions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.depmap import PACKAGE, dependency_map, imported_modules, render, unit_of

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
CHECKED = ("include", "dags", "plugins", "examples", "benchmarks", "scripts", "tests")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80
FOUNDATION = {"errors", "runs", "settings", "signals", "params", "gpumem", "scoring"}


def _block(name: str) -> str:
    text = DOC.read_text()
    return text[text.index(f"<!-- {name}:start -->"):text.index(f"<!-- {name}:end -->")]


def test_the_dependency_map_in_the_doc_is_the_code_s():
    documented = _block("depmap").split("```")[1].strip()
    assert documented == render(dependency_map()), (
        "docs/architecture.md's dependency map is out of date: paste the output of "
        "`.venv/bin/python -m tests.support.depmap` between its depmap markers"
    )


def _a_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of units (its path, first unit repeated at the end), or None."""
    done: set[str] = set()

    def visit(unit: str, path: list[str]) -> list[str] | None:
        if unit in path:
            return path[path.index(unit):] + [unit]
        if unit in done:
            return None
        for dep in sorted(edges.get(unit, ())):
            found = visit(dep, [*path, unit])
            if found:
                return found
        done.add(unit)
        return None

    return next((c for u in sorted(edges) if (c := visit(u, []))), None)


def test_the_dependency_map_has_no_cycle():
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    cycle = _a_cycle(dependency_map())
    assert cycle is None, ("units import each other in a circle: " + " -> ".join(cycle) + "; move what the "
                           "lower unit needs down to it (docs/architecture.md, Dependency map)")


def test_the_kubernetes_trigger_only_waits():
    """The gang's trigger reads the gang's status through the cluster's Connection and yields one
    event: it never loads the estate, places, or writes the run's files (the operator does)."""
    trigger = PACKAGE / "backends" / "k8s" / "trigger.py"
    ours = {m for m in imported_modules(trigger) if m.startswith("hybridflow.")}
    allowed = ("hybridflow.backends.", "hybridflow.hooks.")
    outside = sorted(m for m in ours if not m.startswith(allowed) and m != "hybridflow.errors")
    assert not outside, f"backends/k8s/trigger.py imports {outside}"


# What changes a queue: the local pool's and a backend's writes, and the run's standing file.
QUEUE_WRITES = {"try_acquire", "admit_step", "keep_ticket", "keep_place", "withdraw", "release", "cancel", "stop",
                "note_standing", "keep_standing", "write_json_atomic"}


def test_the_queue_wait_trigger_only_reads_while_it_waits():
    """QueueWaitTrigger polls the queue and yields one event; taking slots, stopping batch gangs and
    writing the run's standing are the task's. Only on_kill (a user stopped the task) withdraws."""
    import ast

    tree = ast.parse((PACKAGE / "queueing.py").read_text())
    trigger = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "QueueWaitTrigger")
    found = {}
    for method in trigger.body:
        if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef) or method.name in ("on_kill", "_stop"):
            continue
        calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                 for n in ast.walk(method) if isinstance(n, ast.Call)}
        if calls & QUEUE_WRITES:
            found[method.name] = sorted(calls & QUEUE_WRITES)
    assert not found, f"QueueWaitTrigger changes the queue while it waits: {found}"


def test_no_module_outside_backends_reaches_into_a_backend_s_own_modules():
    """The operator, DR, metering, node health, admission and the reaper talk to a cluster through the
    gang backend contract (backends.base and the package's choosers), never a backend's own modules."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if unit_of(path) == "backends":
            continue
        taken = {m for m in imported_modules(path) if m.startswith(("hybridflow.backends.k8s", "hybridflow.backends.local"))}
        if taken:
            found[str(path.relative_to(PACKAGE))] = sorted(taken)
    assert not found, f"use the gang backend contract (hybridflow.backends, backends.base, backends.errors): {found}"


# Where the kind of a cluster's backend may be compared with a name: the backends, and the one model
# that declares what each kind offers (Cluster.runs_pods, Cluster.on_this_machine).
BACKEND_NAMED_IN = ("backends/", "config/clusters.py")


def test_no_module_outside_backends_branches_on_a_backend_s_name():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        if where.startswith(BACKEND_NAMED_IN):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and _names_a_backend(node):
                offenders.append(f"{where}:{node.lineno}")
    assert not offenders, ("ask the cluster what its backend offers (runs_pods, on_this_machine) or its "
                           f"GangBackend, instead of comparing its backend's name: {offenders}")


def _names_a_backend(node: ast.Compare) -> bool:
    sides = [node.left, *node.comparators]
    backend = any(isinstance(s, ast.Attribute) and s.attr == "backend" for s in sides)
    named = any(isinstance(s, ast.Constant) and s.value in ("local", "kubernetes") for s in sides)
    return backend and named


# What DR may use of serving: the deploy targets' chooser and contract (the package, serving.base), the
# disaster-recovery side of serving (serving.takeover), and its checks, gate and file helpers.
SERVING_FOR_DR = {"hybridflow.serving", "hybridflow.serving.base", "hybridflow.serving.takeover",
                  "hybridflow.serving.checks", "hybridflow.serving.rollout", "hybridflow.serving.processes"}


def test_dr_serves_through_the_deploy_targets_and_never_builds_a_server_or_manifest():
    """Serving failover and failback, replication's reading of what is served, and the drills reach
    serving through the DeployTarget contract and serving.takeover: no DR module builds a target's
    manifests, starts a model server or reads the gateway's routing files itself."""
    reached = {}
    for path in sorted((PACKAGE / "dr").rglob("*.py")):
        taken = {m for m in imported_modules(path) if m.startswith("hybridflow.serving")} - SERVING_FOR_DR
        if taken:
            reached[str(path.relative_to(PACKAGE))] = sorted(taken)
    assert not reached, f"go through the deploy target (serving.base) or serving.takeover: {reached}"


def test_placement_is_asked_only_through_its_entry():
    """Where a run goes is decided in one place (placement.decide): no module outside placement
    runs the rules or reads the loads they decide on."""
    inner = ("hybridflow.placement.rules", "hybridflow.placement.loads")
    offenders = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
                 if unit_of(p) != "placement" and set(inner) & imported_modules(p)]
    assert not offenders, f"these place a run without placement.decide: {offenders}"


READS = {"read_text", "read_bytes", "open", "load", "loads", "_read_json", "read_json"}


def test_a_placement_travels_only_as_the_task_s_xcom_and_its_copy_is_for_the_run_s_page():
    """placement.json is written for the run's page; no function outside ui/ that names it reads a
    file (a retried train task finds a move from the run's checkpoints, not from a copy)."""
    readers = []
    for path in PACKAGE.rglob("*.py"):
        if unit_of(path) == "ui":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            body = ast.unparse(node)
            if "PLACEMENT_FILE" not in body and "placement.json" not in body:
                continue
            calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                     for n in ast.walk(node) if isinstance(n, ast.Call)}
            if calls & READS:
                readers.append(f"{path.relative_to(PACKAGE)}::{node.name}")
    assert not readers, f"these read the run's placement copy back: {readers}"


def test_the_foundation_storage_and_validation_import_only_what_is_below_them():
    edges = dependency_map()
    for unit in FOUNDATION:
        assert not edges.get(unit), f"{unit} is foundation and imports {sorted(edges[unit])}"
    assert edges["validation"] <= {"errors"}, edges["validation"]
    # settings: where the bandwidth caps' shared state lives on this machine (storage.bandwidth).
    assert edges["storage"] <= {"errors", "runs", "settings"}, edges["storage"]


def test_the_ledger_never_imports_budgets():
    offenders = [str(p.relative_to(REPO)) for p in (PACKAGE / "ledger").rglob("*.py")
                 if any(m == "hybridflow.budgets" or m.startswith("hybridflow.budgets.") for m in imported_modules(p))]
    assert not offenders, f"the ledger imports budgets in {offenders}"


def test_no_operator_imports_the_pipeline_module():
    offenders = [str(p.relative_to(REPO)) for p in (PACKAGE / "operators").rglob("*.py")
                 if {"hybridflow.pipeline"} & imported_modules(p) or any(
                     isinstance(n, ast.ImportFrom) and n.module == "hybridflow"
                     and any(a.name == "pipeline" for a in n.names)
                     for n in ast.walk(ast.parse(p.read_text())))]
    assert not offenders, f"operators import hybridflow.pipeline: {offenders}"


def test_dag_files_take_from_airflow_only_the_sdk():
    for path in sorted((REPO / "dags").glob("*.py")):
        airflow = {m for m in imported_modules(path) if m == "airflow" or m.startswith("airflow.")}
        assert airflow <= {"airflow.sdk"}, f"{path.name} imports {sorted(airflow - {'airflow.sdk'})}"


def _exceptions() -> set[tuple[str, str | None]]:
    """(path, function or None for the whole module) from the doc's size-exceptions table."""
    found = set()
    for line in _block("size-exceptions").splitlines():
        m = re.match(r"\|\s*`([^`]+)`(?:\s*`([^`]+)`)?\s*\|", line)
        if m:
            found.add((m.group(1), m.group(2)))
    return found


def test_no_module_over_500_lines_or_function_over_80_unless_the_doc_says_why():
    allowed, over = _exceptions(), []
    for top in CHECKED:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            text = path.read_text()
            if len(text.splitlines()) > MAX_MODULE_LINES and (rel, None) not in allowed:
                over.append(f"{rel}: {len(text.splitlines())} lines")
            for node in ast.walk(ast.parse(text, rel)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES and (rel, node.name) not in allowed:
                        over.append(f"{rel}: {node.name} is {length} lines")
    assert not over, f"split these, or say why in docs/architecture.md's size exceptions: {over}"


def test_every_listed_size_exception_is_still_needed():
    for rel, function in _exceptions():
        path = REPO / rel
        assert path.exists(), f"size exception for {rel}, which is gone: drop it from the doc"
        if function is None:
            assert len(path.read_text().splitlines()) > MAX_MODULE_LINES, f"{rel} fits now: drop its exception"
        else:
            lengths = [n.end_lineno - n.lineno + 1 for n in ast.walk(ast.parse(path.read_text()))
                       if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function]
            assert lengths and max(lengths) > MAX_FUNCTION_LINES, f"{rel} {function} fits now: drop its exception"


def test_every_unit_of_the_package_is_described_in_the_doc():
    described = _block_before("## Dependency map")
    units = {unit_of(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    missing = sorted(u for u in units if f"`{u}`" not in described and f"`{u}/`" not in described)
    assert not missing, f"docs/architecture.md's package table does not describe: {missing}"


def _block_before(heading: str) -> str:
    text = DOC.read_text()
    return text[text.index("## Packages and modules"):text.index(heading)]
