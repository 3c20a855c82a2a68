"""The model versions an endpoint serves on the Kubernetes serving target (``serving.kubernetes``,
kind ``deployment`` or ``kserve``), read where that target keeps them:

- **what was published**: every bundle deploy put on the models volume, at
  ``<serving.kubernetes.models_dir>/<endpoint>/<version>/<variant>/`` (the folder where the volume
  is mounted on the Airflow workers), in the order it was published (the card is written last, so
  its time is the publish time);
- **what serves now**: the target's ``current()`` asked of the primary's API server, and the canary
  next to it. An API server that does not answer costs only that: the versions are then ordered by
  publish time alone and the problem is reported; the models volume is still read.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hybridflow.dr.replication.replicas import Problem


def _is_bundle(folder: Path) -> bool:
    from hybridflow.bundle import CARD_FILE

    # Folders publish_model is still writing (or moving aside) start with a dot.
    return folder.is_dir() and not folder.name.startswith(".") and (folder / CARD_FILE).is_file()


def published_endpoints(models_dir: Path) -> list[str]:
    """The endpoints with at least one bundle published on the models volume."""
    root = Path(models_dir)
    if not root.is_dir():
        return []
    return sorted(e.name for e in root.iterdir()
                  if e.is_dir() and not e.name.startswith(".") and any(_is_bundle(b) for b in e.glob("*/*")))


def _published_at(bundle: Path) -> float:
    from hybridflow.bundle import CARD_FILE

    return (bundle / CARD_FILE).stat().st_mtime


def published_versions(models_dir: Path, endpoint: str, variants: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One record per version of ``endpoint`` on the models volume, newest publish first:
    ``{version, bundle, model, variant, started_at, published_at}``. A version published in several
    variants is the one ``variants`` names for it (what serves), else the variant published last."""
    from hybridflow.bundle import read_card

    variants = variants or {}
    records = []
    for vdir in sorted((Path(models_dir) / endpoint).glob("*/")):
        if vdir.name.startswith("."):
            continue
        found = []
        for bundle in vdir.iterdir():
            if not _is_bundle(bundle):
                continue
            try:
                card = read_card(bundle)
                when = _published_at(bundle)
            except (OSError, ValueError):
                continue  # a damaged card: its version cannot be served, the others still count
            found.append((bundle.name == variants.get(vdir.name), when, bundle, card))
        if not found:
            continue
        _, when, bundle, card = max(found, key=lambda f: (f[0], f[1], f[2].name))
        records.append({"version": vdir.name, "bundle": str(bundle), "model": card.model, "variant": bundle.name,
                        "published_at": when,
                        "started_at": datetime.fromtimestamp(when, UTC).isoformat(timespec="microseconds")})
    return sorted(records, key=lambda r: (r["published_at"], r["version"]), reverse=True)


def live_versions(estate, settings, endpoint: str) -> dict[str, str | None]:
    """version -> variant (None where the target does not say) of what the target serves now:
    the stable version and a canary beside it. Raises what the API server's client raises."""
    from hybridflow.serving import deploy_target

    return deploy_target(estate, endpoint, state_dir=Path(settings.state_dir)).live_versions()


def k8s_served_versions(estate, settings, endpoint: str, problems: list[Problem]) -> list[dict[str, Any]]:
    """The versions of ``endpoint`` on the models volume, newest first, the one serving now (and its
    canary) first whatever their age; an API server that does not answer is added to ``problems``."""
    k8s = estate.pipeline.serving.kubernetes
    where = f"serving cluster {k8s.cluster}"
    try:
        live = live_versions(estate, settings, endpoint)
    except Exception as exc:  # noqa: BLE001 - the models volume is still readable: copy by publish time
        problems.append(Problem("model", endpoint, where, f"cannot tell which version serves now "
                                f"({type(exc).__name__}: {exc}); the versions on {k8s.models_dir} were "
                                "replicated newest publish first"))
        live = {}
    variants = {v: variant for v, variant in live.items() if variant}
    records = published_versions(Path(k8s.models_dir), endpoint, variants)
    published = {r["version"] for r in records}
    for version in sorted(set(live) - published):
        problems.append(Problem("model", endpoint, where, f"version {version} serves, but it is not on the models "
                                f"volume ({k8s.models_dir}/{endpoint}); it cannot be replicated"))
    return sorted(records, key=lambda r: r["version"] in live, reverse=True)  # stable: newest first otherwise
