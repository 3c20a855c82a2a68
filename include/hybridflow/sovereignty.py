"""The sovereignty guard: whether a dataset may be copied to a store, decided from the catalogue.

Placement already keeps restricted data on private clusters and region-limited data in its
regions; the guard repeats the decision where data actually moves (staging), from its own fresh
reading of ``datasets.yaml``, so neither a placement override, a stale XCom nor a forged Param can
move data where its owner does not allow. A dataset the catalogue does not list is handled as
restricted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridflow.config.catalogue import CLASSIFICATIONS, UNCLASSIFIED, read_catalogue, stricter
from hybridflow.errors import SovereigntyError, StagingError

LOCATIONS = ("private", "public")


@dataclass(frozen=True)
class Destination:
    """Where a copy would land: the store's location, the regions/jurisdictions it is in, and a name
    for messages (the cluster)."""

    location: str
    areas: tuple[str, ...] = ()
    name: str = ""


def check_sovereignty(
    dataset: str, destination: Destination, *, catalogue: Path | str, raised: str | None = None
) -> str:
    """Raise SovereigntyError unless ``dataset`` may be copied to ``destination``; returns the
    classification it is handled as (the catalogue's, or ``raised`` when that is stricter)."""
    # The messages name the file: a str path must refuse with SovereigntyError, not AttributeError.
    catalogue = Path(catalogue)
    if destination.location not in LOCATIONS:
        raise StagingError(f"target location {destination.location!r} is unknown; use one of {', '.join(LOCATIONS)}")
    if raised is not None and raised not in CLASSIFICATIONS:
        raise StagingError(f"classification {raised!r} is unknown; use one of {', '.join(CLASSIFICATIONS)}")
    entry = read_catalogue(catalogue).datasets.get(dataset)
    own = entry.effective_classification if entry is not None else UNCLASSIFIED
    effective = stricter(own, raised) if raised else own
    where = _describe(destination)
    if effective == "restricted" and destination.location != "private":
        why = "is restricted" if entry is not None else f"is not in {catalogue.name}, so it is handled as restricted"
        raise SovereigntyError(
            f"dataset {dataset!r} {why} and the target store is {where}: restricted data never leaves private "
            "storage; run it on a private cluster"
        )
    allowed = entry.regions if entry is not None else []
    if allowed and not set(destination.areas) & set(allowed):
        raise SovereigntyError(
            f"dataset {dataset!r} may only be processed in {', '.join(allowed)} ({catalogue.name}) and the target "
            f"store is {where}; run it on a cluster in {' or '.join(allowed)}"
        )
    return effective


def _describe(destination: Destination) -> str:
    """``cloud-east (public, us-east-1 / us)``; ``a public store`` when the destination has no name."""
    areas = " / ".join(destination.areas)
    if destination.name:
        return f"{destination.name} ({destination.location}" + (f", {areas})" if areas else ")")
    return f"a {destination.location} store" + (f" ({areas})" if areas else "")
