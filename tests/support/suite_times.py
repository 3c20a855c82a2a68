"""The suite's time by part, from pytest's JUnit reports (``.ci/run`` writes them to .ci/reports/).

    .venv/bin/python -m tests.support.suite_times .ci/reports/sqlite.xml [.ci/reports/postgres.xml]

prints, per report, one row per part of docs/testing.md's table: tests run and seconds spent in them.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict

PARTS = ("tests/unit", "tests/integration", "tests/dags", "tests/services", "tests/k8s_real")


def part_of(classname: str) -> str:
    """``tests.unit.test_x.TestY`` -> ``tests/unit``; top-level test modules -> ``tests/test_*.py``."""
    path = classname.replace(".", "/")
    return next((p for p in PARTS if path.startswith(p + "/")), "tests/test_*.py")


def times(report: str) -> dict[str, tuple[int, float]]:
    count: dict[str, int] = defaultdict(int)
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        part = part_of(case.get("classname", ""))
        count[part] += 1
        seconds[part] += float(case.get("time", 0))
    return {p: (count[p], seconds[p]) for p in sorted(count)}


def main(argv: list[str]) -> int:
    for report in argv:
        rows = times(report)
        total = sum(s for _, s in rows.values())
        print(f"{report}: {sum(n for n, _ in rows.values())} tests, {total / 60:.1f} min in tests")
        for part, (n, s) in rows.items():
            print(f"| `{part}` | {n} | {s / 60:.1f} min |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
