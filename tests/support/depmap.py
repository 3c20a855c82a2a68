"""The dependency map of include/hybridflow: which package or top-level module imports which.

``python -m tests.support.depmap`` prints the block docs/architecture.md holds between its
``depmap`` markers; tests/test_architecture.py checks that the two agree. Imports inside functions
count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "include" / "hybridflow"


def unit_of(path: Path) -> str:
    """The package (first folder) or top-level module a file belongs to."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def imported_modules(path: Path) -> set[str]:
    """Dotted names a file imports (absolute imports only, at any depth)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def imported_units(path: Path) -> set[str]:
    return {name.split(".")[1] for name in imported_modules(path) if name.startswith("hybridflow.")}


def dependency_map() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = unit_of(path)
        if unit == "__init__":
            continue
        edges[unit] |= imported_units(path) - {unit}
    return dict(edges)


def render(edges: dict[str, set[str]]) -> str:
    width = max(len(u) for u in edges)
    return "\n".join(f"{u:<{width}} -> {', '.join(sorted(d)) or '(nothing)'}" for u, d in sorted(edges.items()))


if __name__ == "__main__":
    print(render(dependency_map()))
