"""The platform runs any registered model: no platform module names an example's data or model.

The examples live in ``examples/hybridflow_examples`` and are wired in only through
``config/datasets.yaml`` and ``config/models.yaml``; if a platform module mentions one of them, the
platform has grown a special case that another team's model would not get.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLATFORM = [REPO / "include" / "hybridflow", REPO / "dags", REPO / "plugins"]
# Words only the examples' data and models use (the digits images, the breast-cancer table).
# "digits" alone is also plain English (hex digits, isdigit()): the example's name is matched as a name.
EXAMPLE_WORDS = re.compile(r"digits?[-_]|[\"'/]digits\b|\bdigits?[\"'/]|digit images?|handwrit|pixel|mnist|breast|"
                           r"cancer|malignan|tumou?r", re.IGNORECASE)


def test_no_platform_module_names_an_example():
    offenders = []
    for root in PLATFORM:
        for path in sorted(root.rglob("*")):
            if not path.is_file() or path.suffix not in (".py", ".mako", ".html", ".js", ".json", ".yaml"):
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
                if EXAMPLE_WORDS.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "platform modules that name an example:\n" + "\n".join(offenders)


def test_the_check_finds_what_it_looks_for(tmp_path):
    # The pattern is not vacuous: the examples themselves match it.
    examples = REPO / "examples" / "hybridflow_examples"
    assert any(EXAMPLE_WORDS.search(p.read_text()) for p in examples.rglob("*.py"))
