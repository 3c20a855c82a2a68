"""Build the Go binaries of a real Kubernetes test control plane, once per version.

Each upstream project has a small wrapper Go module under ``modules/<project>/`` that pins
the project's version (and copies the ``replace`` directives the project's own go.mod needs).
``build()`` compiles each binary from its wrapper with the Go toolchain, fetching sources
through the Go module proxy, into ``cache_root()/<project>-<version>/bin/``: outside the
repository, so a version bump builds anew and a present binary is never rebuilt.
Go's own caches (GOCACHE, GOMODCACHE) stay at Go's defaults.

Run ``python -m hybridflow.devenv.k8s.build [names...]`` to build and print the paths.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from hybridflow.errors import HybridFlowError

MODULES_DIR = Path(__file__).resolve().parent / "modules"

# Project -> version. Each must match the pin in modules/<project>/go.mod.
VERSIONS: dict[str, str] = {
    "kubernetes": "v1.36.3",
    "etcd": "v3.6.8",  # the go.etcd.io/etcd/client/v3 that k8s.io/kubernetes v1.36.3 requires
    "kwok": "v0.7.0",
    "kueue": "v0.19.0",
    "volcano": "v1.10.0",
    "kserve": "v0.20.0",
}

# Project -> the upstream Go module its version is of.
MODULES: dict[str, str] = {
    "kubernetes": "k8s.io/kubernetes",
    "etcd": "go.etcd.io/etcd/server/v3",
    "kwok": "sigs.k8s.io/kwok",
    "kueue": "sigs.k8s.io/kueue",
    "volcano": "volcano.sh/volcano",
    "kserve": "github.com/kserve/kserve",
}


@dataclass(frozen=True)
class Binary:
    name: str
    project: str
    package: str


# In build order.
_BINARIES: tuple[Binary, ...] = (
    Binary("etcd", "etcd", "go.etcd.io/etcd/server/v3"),
    Binary("kube-apiserver", "kubernetes", "k8s.io/kubernetes/cmd/kube-apiserver"),
    Binary("kube-controller-manager", "kubernetes", "k8s.io/kubernetes/cmd/kube-controller-manager"),
    Binary("kube-scheduler", "kubernetes", "k8s.io/kubernetes/cmd/kube-scheduler"),
    Binary("kwok", "kwok", "sigs.k8s.io/kwok/cmd/kwok"),
    Binary("kueue", "kueue", "sigs.k8s.io/kueue/cmd/kueue"),
    Binary("vc-scheduler", "volcano", "volcano.sh/volcano/cmd/scheduler"),
    Binary("vc-controller-manager", "volcano", "volcano.sh/volcano/cmd/controller-manager"),
    Binary("vc-webhook-manager", "volcano", "volcano.sh/volcano/cmd/webhook-manager"),
    Binary("kserve-manager", "kserve", "github.com/kserve/kserve/cmd/manager"),
)

# Add-on project -> folders (relative to the upstream module's root) holding its CRD YAMLs.
# volcano's bases include bus.volcano.sh; its controller-manager also runs the jobflow
# controllers, whose CRDs are apart.
_CRD_DIRS: dict[str, tuple[str, ...]] = {
    "kueue": ("config/components/crd/bases",),
    "volcano": ("config/crd/volcano/bases", "config/crd/jobflow/bases"),
    "kserve": ("config/crd/full",),
}

_LOG_TAIL_LINES = 15
# What go prints when the module proxy will not serve a module version (the public proxy answers
# "403 Forbidden ... This module version is not available", others 404 or 410).
_REFUSED = re.compile(r"not available|: (?:403|404|410) [A-Z]|server response: not found|unknown revision")
_MODULE_AT = re.compile(r"([A-Za-z0-9][\w.\-~]*(?:/[\w.\-~+]+)+)@(v[\w.\-+]+)")


class BuildError(HybridFlowError):
    """A control-plane binary could not be built."""


def cache_root() -> Path:
    """Where binaries go: ``$HYBRIDFLOW_K8S_CACHE``, else ``~/.cache/hybridflow/k8s``."""
    override = os.environ.get("HYBRIDFLOW_K8S_CACHE")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "hybridflow" / "k8s"


def _project_dir(project: str) -> Path:
    return cache_root() / f"{project}-{VERSIONS[project]}"


def binaries() -> dict[str, Path]:
    """Binary name -> its path in the cache (present or not), in build order."""
    return {b.name: _project_dir(b.project) / "bin" / b.name for b in _BINARIES}


def _ldflags(project: str) -> str:
    flags = ["-s", "-w"]
    version = VERSIONS[project]
    if project == "kubernetes":
        # What hack/lib/version.sh sets; without it the components report v0.0.0-master.
        major, minor = version.lstrip("v").split(".")[:2]
        for pkg in ("k8s.io/client-go/pkg/version", "k8s.io/component-base/version"):
            flags += [
                f"-X {pkg}.gitVersion={version}",
                f"-X {pkg}.gitMajor={major}",
                f"-X {pkg}.gitMinor={minor}",
                f"-X {pkg}.gitTreeState=clean",
            ]
    elif project == "kueue":
        flags.append(f"-X sigs.k8s.io/kueue/pkg/version.GitVersion={version}")
    elif project == "volcano":
        flags.append(f"-X volcano.sh/volcano/pkg/version.Version={version}")
    return " ".join(flags)


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    goflags = env.get("GOFLAGS", "").split()
    if "-trimpath" not in goflags:
        goflags.append("-trimpath")
    env["GOFLAGS"] = " ".join(goflags)
    env["CGO_ENABLED"] = "0"
    return env


def _version_tuple(text: str) -> tuple[int, ...]:
    match = re.match(r"(?:go)?(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    if not match:
        return ()
    return tuple(int(part or 0) for part in match.groups())


def _needed_go(modules_dir: Path) -> str:
    """The highest ``go`` line among the wrapper modules."""
    needed = "1.24"
    for gomod in sorted(modules_dir.glob("*/go.mod")):
        match = re.search(r"^go\s+(\S+)\s*$", gomod.read_text(), re.MULTILINE)
        if match and _version_tuple(match.group(1)) > _version_tuple(needed):
            needed = match.group(1)
    return needed


def check_go(modules_dir: Path | None = None) -> str:
    """The Go version found (``go1.26.8``); BuildError if ``go`` is missing or too old."""
    modules_dir = modules_dir or MODULES_DIR
    needed = _needed_go(modules_dir)
    short_needed = ".".join(needed.split(".")[:2])
    fix = f"install Go {short_needed} or newer, or set GOTOOLCHAIN=go{needed}"
    go = shutil.which("go")
    if go is None:
        raise BuildError(
            f"Go {short_needed} or newer is needed to build the k8s test binaries, found no `go` on PATH: {fix}"
        )
    try:
        out = subprocess.run(
            [go, "version"], capture_output=True, text=True, env=_go_env(), timeout=120, check=True
        ).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        raise BuildError(f"`go version` failed ({exc}); Go {short_needed} or newer is needed: {fix}") from exc
    match = re.search(r"\bgo version (\S+)", out)
    found = match.group(1) if match else out.strip() or "nothing"
    if found.startswith("devel"):
        return found
    if not _version_tuple(found) or _version_tuple(found) < _version_tuple(needed):
        raise BuildError(f"Go {short_needed} or newer is needed, found {found}: {fix}")
    return found


def _tail(log_path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _failure(binary: Binary, log_path: Path, modules_dir: Path) -> BuildError:
    tail = _tail(log_path)
    what = f"{binary.name} ({MODULES[binary.project]} {VERSIONS[binary.project]})"
    wrapper = modules_dir / binary.project
    refused = [line.strip() for line in tail.splitlines() if _REFUSED.search(line)]
    if refused:
        named = [(line, m) for line in refused if (m := _MODULE_AT.search(line))]
        line, found = named[0] if named else (refused[0], None)
        module = f"{found.group(1)}@{found.group(2)}" if found else "a module"
        return BuildError(
            f"building {what}: the Go module proxy refused {module} ({line}). "
            f"Fix: pin a version the proxy serves in {wrapper}/go.mod (and VERSIONS in build.py), "
            f"then run `go mod tidy` there; check GOPROXY ({os.environ.get('GOPROXY', 'default')}). "
            f"Full log: {log_path}"
        )
    return BuildError(
        f"building {what} failed; last lines of {log_path}:\n{tail}\n"
        f"Fix: read the log; a compile error usually means the wrapper in {wrapper} pins a dependency "
        "that does not match the project's own go.mod (copy its require/replace lines, then `go mod tidy`)."
    )


def _build_one(binary: Binary, out: Path, modules_dir: Path, go: str) -> None:
    project_dir = out.parent.parent
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = project_dir / f"build-{binary.name}.log"
    tmp = out.with_name(f".{binary.name}.tmp-{os.getpid()}")
    cmd = [go, "build", "-o", str(tmp), f"-ldflags={_ldflags(binary.project)}", binary.package]
    try:
        with open(log_path, "w") as log_file:
            log_file.write(f"$ (cd {modules_dir / binary.project} && {' '.join(cmd)})\n")
            log_file.flush()
            proc = subprocess.run(
                cmd,
                cwd=modules_dir / binary.project,
                env=_go_env(),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        if proc.returncode != 0 or not tmp.is_file():
            raise _failure(binary, log_path, modules_dir)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def build(
    names: Iterable[str] | None = None,
    *,
    log: Callable[[str], object] = print,
    modules_dir: Path | None = None,
) -> dict[str, Path]:
    """Build every missing binary of ``names`` (default: all); return name -> path.

    A present binary is reused, never rebuilt. Each is built into a temp file and renamed into
    place, so an interrupted build leaves no half binary.
    """
    modules_dir = Path(modules_dir) if modules_dir else MODULES_DIR
    paths = binaries()
    wanted = list(paths) if names is None else list(names)
    unknown = [n for n in wanted if n not in paths]
    if unknown:
        raise BuildError(f"unknown binaries {unknown}; known: {', '.join(paths)}")
    selected = [b for b in _BINARIES if b.name in wanted]
    started = time.monotonic()
    built = 0
    go: str | None = None
    for binary in selected:
        out = paths[binary.name]
        if out.is_file():
            continue
        if go is None:
            check_go(modules_dir)
            go = shutil.which("go") or "go"
        log(f"building {binary.name} ({MODULES[binary.project]} {VERSIONS[binary.project]}) ...")
        t0 = time.monotonic()
        _build_one(binary, out, modules_dir, go)
        built += 1
        log(f"built {binary.name} in {time.monotonic() - t0:.0f} s")
    log(
        f"k8s test binaries: {built} built, {len(selected) - built} reused, "
        f"in {time.monotonic() - started:.1f} s ({cache_root()})"
    )
    return {b.name: paths[b.name] for b in selected}


def module_dir(project: str, modules_dir: Path | None = None) -> Path:
    """The root of ``project``'s upstream module (at its pinned version) in Go's module cache,
    downloaded through the proxy if needed: where its CRDs, webhook manifests and stages are read."""
    modules_dir = Path(modules_dir) if modules_dir else MODULES_DIR
    module = f"{MODULES[project]}@{VERSIONS[project]}"
    proc = subprocess.run(
        ["go", "mod", "download", "-json", module],
        cwd=modules_dir / project,
        env=_go_env(),
        capture_output=True,
        text=True,
    )
    try:
        info = json.loads(proc.stdout or "{}")
    except json.JSONDecodeError:
        info = {}
    if proc.returncode != 0 or "Dir" not in info:
        cause = info.get("Error") or proc.stderr.strip() or proc.stdout.strip()
        refused = " (the Go module proxy refused it)" if _REFUSED.search(cause) else ""
        raise BuildError(
            f"could not download {module}{refused}: {cause}. Fix: check GOPROXY and the pinned version"
        )
    return Path(info["Dir"])


def crd_dirs(modules_dir: Path | None = None) -> dict[str, list[Path]]:
    """Add-on (kueue, volcano, kserve) -> the folders of its CRD YAMLs in the Go module cache.

    Folders may also hold a kustomization.yaml (no CRD); kserve's has a subfolder llmisvc/.
    """
    result: dict[str, list[Path]] = {}
    for project, rels in _CRD_DIRS.items():
        root = module_dir(project, modules_dir)
        result[project] = []
        for rel in rels:
            path = root / rel
            if not path.is_dir():
                raise BuildError(
                    f"{MODULES[project]}@{VERSIONS[project]} has no CRD folder {rel}: update _CRD_DIRS in {__file__}"
                )
            result[project].append(path)
    return result


def main(argv: list[str] | None = None) -> int:
    names = (sys.argv[1:] if argv is None else argv) or None
    try:
        paths = build(names)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
