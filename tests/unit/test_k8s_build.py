"""Error paths and reuse of the k8s test-binary build, without building anything big."""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from pathlib import Path

import pytest

from hybridflow.devenv.k8s import build as k8s_build
from hybridflow.devenv.k8s.build import BuildError


def _fake_go(bin_dir: Path, body: str) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    go = bin_dir / "go"
    go.write_text(f"#!/bin/sh\n{body}\n")
    go.chmod(0o755)
    return go


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "k8s-cache"
    monkeypatch.setenv("HYBRIDFLOW_K8S_CACHE", str(root))
    return root


def test_binaries_live_in_a_folder_per_project_and_version(cache):
    paths = k8s_build.binaries()
    assert (
        paths["kube-apiserver"]
        == cache / f"kubernetes-{k8s_build.VERSIONS['kubernetes']}" / "bin" / "kube-apiserver"
    )
    assert paths["etcd"].parent.parent.name == f"etcd-{k8s_build.VERSIONS['etcd']}"
    assert set(k8s_build.VERSIONS) == {"kubernetes", "etcd", "kwok", "kueue", "volcano", "kserve"}


def test_cache_root_defaults_to_the_user_cache(monkeypatch):
    monkeypatch.delenv("HYBRIDFLOW_K8S_CACHE", raising=False)
    assert k8s_build.cache_root() == Path.home() / ".cache" / "hybridflow" / "k8s"


def test_wrapper_modules_pin_the_versions():
    for project, version in k8s_build.VERSIONS.items():
        gomod = (k8s_build.MODULES_DIR / project / "go.mod").read_text()
        assert f"{k8s_build.MODULES[project]} {version}" in gomod, project
        assert (k8s_build.MODULES_DIR / project / "go.sum").is_file(), project


def test_check_go_names_an_old_version(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    _fake_go(bin_dir, 'echo "go version go1.22.1 linux/amd64"')
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(BuildError) as err:
        k8s_build.check_go()
    message = str(err.value)
    assert "found go1.22.1" in message
    assert "1.26 or newer is needed" in message
    assert "GOTOOLCHAIN" in message


def test_check_go_without_go(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BuildError, match="found no `go` on PATH"):
        k8s_build.check_go()


def test_check_go_accepts_a_new_enough_version(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    _fake_go(bin_dir, 'echo "go version go1.27.3 linux/amd64"')
    monkeypatch.setenv("PATH", str(bin_dir))
    assert k8s_build.check_go() == "go1.27.3"


def test_build_checks_go_before_building(cache, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    _fake_go(bin_dir, 'echo "go version go1.21.0 linux/amd64"')
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(BuildError, match="found go1.21.0"):
        k8s_build.build(["etcd"], log=lambda _msg: None)
    assert not k8s_build.binaries()["etcd"].exists()


def test_present_binaries_are_reused_without_running_go(cache, tmp_path, monkeypatch):
    marker = tmp_path / "go-was-run"
    _fake_go(tmp_path / "bin", f"touch {marker}; exit 1")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    for path in k8s_build.binaries().values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("fake binary")
    messages: list[str] = []
    result = k8s_build.build(log=messages.append)
    assert result == k8s_build.binaries()
    assert not marker.exists()
    assert not any(m.startswith("building") for m in messages)
    assert "0 built" in messages[-1]


def test_unknown_binary_is_refused(cache):
    with pytest.raises(BuildError, match="unknown binaries"):
        k8s_build.build(["kubelet"], log=lambda _msg: None)


@pytest.fixture
def empty_proxy(tmp_path):
    """A module proxy on loopback that serves nothing (404 for every module version)."""
    root = tmp_path / "proxy"
    root.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.skipif(shutil.which("go") is None, reason="needs the Go toolchain")
def test_a_refused_module_names_module_and_version(cache, tmp_path, monkeypatch, empty_proxy):
    modules = tmp_path / "modules"
    wrapper = modules / "kwok"
    wrapper.mkdir(parents=True)
    (wrapper / "go.mod").write_text(
        "module example.test/wrapper\n\ngo 1.24.0\n\nrequire sigs.k8s.io/kwok v0.99.0\n"
    )
    fake_hash = "h1:" + "A" * 43 + "="
    (wrapper / "go.sum").write_text(
        f"sigs.k8s.io/kwok v0.99.0 {fake_hash}\nsigs.k8s.io/kwok v0.99.0/go.mod {fake_hash}\n"
    )
    monkeypatch.setenv("GOPROXY", empty_proxy)
    monkeypatch.setenv("GOMODCACHE", str(tmp_path / "gomodcache"))
    monkeypatch.setenv("GOSUMDB", "off")
    monkeypatch.setenv("GOFLAGS", "")
    for var in ("GOPRIVATE", "GONOPROXY", "GOTOOLCHAIN"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(BuildError) as err:
        k8s_build.build(["kwok"], log=lambda _msg: None, modules_dir=modules)
    message = str(err.value)
    assert "sigs.k8s.io/kwok@v0.99.0" in message
    assert "proxy refused" in message
    assert "kwok" in message.split(":")[0]
    out = k8s_build.binaries()["kwok"]
    assert not out.exists()
    assert not any(p.name.startswith(".kwok.tmp") for p in out.parent.iterdir())
    assert (out.parent.parent / "build-kwok.log").is_file()


def test_the_public_proxys_refusal_is_recognised(cache, tmp_path):
    log = tmp_path / "build-kserve-manager.log"
    log.write_text(
        "go: downloading github.com/kserve/kserve v0.16.1\n"
        "go: github.com/kserve/kserve@v0.16.1: reading https://proxy.golang.org/github.com/kserve/kserve/"
        "@v/v0.16.1.info: 403 Forbidden\n"
        "\tserver response: This module version is not available.\n"
    )
    binary = next(b for b in k8s_build._BINARIES if b.name == "kserve-manager")
    err = k8s_build._failure(binary, log, k8s_build.MODULES_DIR)
    assert "proxy refused github.com/kserve/kserve@v0.16.1" in str(err)
    assert str(err).startswith("building kserve-manager")


def test_a_compile_error_is_not_taken_for_a_refusal(cache, tmp_path):
    log = tmp_path / "build-kwok.log"
    log.write_text("# sigs.k8s.io/kwok/pkg/x\nx/y.go:404:2: undefined: Foo\n")
    binary = next(b for b in k8s_build._BINARIES if b.name == "kwok")
    err = k8s_build._failure(binary, log, k8s_build.MODULES_DIR)
    assert "refused" not in str(err)
    assert "undefined: Foo" in str(err)
    assert "Fix:" in str(err)
