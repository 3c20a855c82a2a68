"""Writing an example dataset into private storage: same bytes every time, each file replaced
atomically, so seeding again changes nothing and a reader never sees half a file."""

from __future__ import annotations

from pathlib import Path


def write_file(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_file() and target.read_bytes() == data:
        return
    tmp = target.with_name(f".{target.name}.part")  # dot-files are never staged or validated
    tmp.write_bytes(data)
    tmp.replace(target)


def copy_suites(package_dir: Path, folder: Path) -> None:
    """The example's expectation suites travel with its data, as a data team would keep them."""
    for suite in sorted((package_dir / "expectations").glob("*.json")):
        write_file(folder / "expectations" / suite.name, suite.read_bytes())


__all__ = ["copy_suites", "write_file"]
