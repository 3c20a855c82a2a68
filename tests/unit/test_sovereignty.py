"""The sovereignty guard: what may be copied where, decided from a fresh reading of datasets.yaml."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridflow.errors import ConfigError, SovereigntyError, StagingError
from hybridflow.sovereignty import Destination, check_sovereignty

# Where copies would land, as clusters.yaml describes clusters: location, region and jurisdiction.
PUBLIC_US = Destination("public", ("us-east-1", "us"), "cloud-east")
PUBLIC_EU = Destination("public", ("eu-west-1", "eu"), "cloud-eu")
PRIVATE_EU = Destination("private", ("dc-1", "eu"), "onprem-a")


def write_catalogue(path: Path, datasets: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write a datasets.yaml at ``path`` describing synthetic datasets, and return ``path``.

    Each value holds what the scenario needs (``classification``, ``regions``); the rest is the
    smallest entry the catalogue accepts, so only those keys decide what the guard does. Leave
    ``classification`` out for an unclassified entry.
    """
    entries = {
        name: {
            "location": f"private://datasets/{name}",
            "format": "shards",
            "splits": {"train": {"files": ["**"]}},
            "holdout": "train",
            "suite": "expectations/train.json",
            **dict(extra),
        }
        for name, extra in datasets.items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"datasets": entries}, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture
def catalogue(tmp_path) -> Path:
    return write_catalogue(tmp_path / "datasets.yaml", {
        "patients": {"classification": "restricted"},
        "digits": {"classification": "internal"},
        "open-data": {"classification": "public"},
        "loose": {},  # no classification: handled as restricted
        "eu-claims": {"classification": "internal", "regions": ["eu"]},
        "dublin-only": {"classification": "internal", "regions": ["eu-west-1"]},
    })


def test_restricted_data_is_refused_towards_a_public_store_naming_the_dataset_and_the_fix(catalogue):
    with pytest.raises(SovereigntyError) as err:
        check_sovereignty("patients", PUBLIC_EU, catalogue=catalogue)
    message = str(err.value)
    assert "'patients'" in message and "is restricted" in message
    assert "cloud-eu (public" in message  # which store was refused
    assert "run it on a private cluster" in message
    # the same data may go to private storage, and is handled as restricted there
    assert check_sovereignty("patients", PRIVATE_EU, catalogue=catalogue) == "restricted"


@pytest.mark.parametrize(("dataset", "classification"), [("digits", "internal"), ("open-data", "public")])
def test_internal_and_public_data_may_go_to_a_public_store(catalogue, dataset, classification):
    assert check_sovereignty(dataset, PUBLIC_US, catalogue=catalogue) == classification


def test_an_entry_without_a_classification_is_handled_as_restricted(catalogue):
    with pytest.raises(SovereigntyError, match=r"'loose' is restricted.*run it on a private cluster"):
        check_sovereignty("loose", PUBLIC_US, catalogue=catalogue)
    assert check_sovereignty("loose", PRIVATE_EU, catalogue=catalogue) == "restricted"


def test_a_dataset_missing_from_the_catalogue_is_refused_as_restricted(catalogue):
    with pytest.raises(SovereigntyError) as err:
        check_sovereignty("unlisted", PUBLIC_EU, catalogue=catalogue)
    message = str(err.value)
    assert "'unlisted' is not in datasets.yaml, so it is handled as restricted" in message
    assert "run it on a private cluster" in message
    assert check_sovereignty("unlisted", PRIVATE_EU, catalogue=catalogue) == "restricted"


def test_a_run_may_raise_the_classification_but_never_lower_it(catalogue):
    with pytest.raises(SovereigntyError, match=r"'digits' is restricted"):
        check_sovereignty("digits", PUBLIC_US, catalogue=catalogue, raised="restricted")
    assert check_sovereignty("digits", PRIVATE_EU, catalogue=catalogue, raised="restricted") == "restricted"
    # a lower classification asked for by the run changes nothing: the data's own one stands
    assert check_sovereignty("digits", PUBLIC_US, catalogue=catalogue, raised="public") == "internal"
    with pytest.raises(SovereigntyError, match="restricted"):
        check_sovereignty("patients", PUBLIC_US, catalogue=catalogue, raised="public")


@pytest.mark.parametrize("destination", [
    PUBLIC_US,
    Destination("public", ("us-east-1",), "cloud-east"),  # a region alone, no jurisdiction
    Destination("private", ("dc-9", "us"), "onprem-us"),  # private storage outside the regions too
    Destination("public", (), "somewhere"),  # a store that cannot show it is in the EU
])
def test_eu_only_data_is_refused_outside_the_eu(catalogue, destination):
    with pytest.raises(SovereigntyError) as err:
        check_sovereignty("eu-claims", destination, catalogue=catalogue)
    message = str(err.value)
    assert "'eu-claims' may only be processed in eu" in message
    assert "run it on a cluster in eu" in message


@pytest.mark.parametrize("destination", [
    PUBLIC_EU,
    Destination("public", ("eu",), "cloud-eu"),  # by jurisdiction alone
    PRIVATE_EU,
])
def test_eu_only_data_may_go_to_a_store_in_the_eu(catalogue, destination):
    assert check_sovereignty("eu-claims", destination, catalogue=catalogue) == "internal"


def test_regions_may_name_a_cluster_region_rather_than_a_jurisdiction(catalogue):
    assert check_sovereignty("dublin-only", PUBLIC_EU, catalogue=catalogue) == "internal"
    with pytest.raises(SovereigntyError, match="may only be processed in eu-west-1"):
        check_sovereignty("dublin-only", Destination("public", ("eu-central-1", "eu"), "cloud-fra"),
                          catalogue=catalogue)


def test_the_guard_reads_the_catalogue_again_on_every_call(tmp_path):
    path = tmp_path / "datasets.yaml"

    def rewrite(classification: str, regions: list[str]) -> None:
        # Every version is written with the same length and modification time, so nothing keyed
        # on the file's metadata could tell them apart: only reading the file again does.
        write_catalogue(path, {"claims": {"classification": classification, "regions": regions}})
        body = path.read_text()
        path.write_text(body + "#" * (399 - len(body)) + "\n")
        assert path.stat().st_size == 400
        os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))

    rewrite("internal", [])
    assert check_sovereignty("claims", PUBLIC_US, catalogue=path) == "internal"
    rewrite("restricted", [])
    with pytest.raises(SovereigntyError, match="'claims' is restricted"):
        check_sovereignty("claims", PUBLIC_US, catalogue=path)
    rewrite("internal", ["eu"])
    with pytest.raises(SovereigntyError, match="may only be processed in eu"):
        check_sovereignty("claims", PUBLIC_US, catalogue=path)
    assert check_sovereignty("claims", PUBLIC_EU, catalogue=path) == "internal"
    rewrite("internal", [])
    assert check_sovereignty("claims", PUBLIC_US, catalogue=path) == "internal"


def test_a_catalogue_given_as_a_string_path_refuses_the_same_way(catalogue):
    with pytest.raises(SovereigntyError, match="'patients' is restricted"):
        check_sovereignty("patients", PUBLIC_US, catalogue=str(catalogue))
    with pytest.raises(SovereigntyError, match="is not in datasets.yaml"):
        check_sovereignty("unlisted", PUBLIC_US, catalogue=str(catalogue))


def test_a_catalogue_that_cannot_be_read_stops_the_copy(tmp_path, catalogue):
    with pytest.raises(ConfigError, match="file not found"):
        check_sovereignty("digits", PUBLIC_US, catalogue=tmp_path / "missing.yaml")
    catalogue.write_text(catalogue.read_text() + "  broken: {location: nowhere}\n")
    with pytest.raises(ConfigError):
        check_sovereignty("digits", PUBLIC_US, catalogue=catalogue)


def test_unknown_locations_and_classifications_are_refused(catalogue):
    with pytest.raises(StagingError, match="target location 'cloud' is unknown; use one of private, public"):
        check_sovereignty("digits", Destination("cloud", ("us",), "x"), catalogue=catalogue)
    with pytest.raises(StagingError, match="classification 'secret' is unknown"):
        check_sovereignty("digits", PRIVATE_EU, catalogue=catalogue, raised="secret")


def test_a_refusal_names_an_unnamed_store_by_its_location(catalogue):
    with pytest.raises(SovereigntyError) as err:
        check_sovereignty("patients", Destination("public"), catalogue=catalogue)
    assert "the target store is a public store:" in str(err.value)
