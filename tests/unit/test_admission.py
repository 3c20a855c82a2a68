"""Admission: good requests become an AdmittedRun; every bad one is refused by field, with no side effects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.admission import PARAM_DEFAULTS, AdmittedRun, RunRequest, admit
from hybridflow.config import Estate, load_estate
from hybridflow.errors import AdmissionError
from hybridflow.settings import REPO_ROOT


@pytest.fixture(scope="module")
def estate() -> Estate:
    return load_estate(REPO_ROOT / "config", use_cache=False)


@pytest.fixture
def private_root(tmp_path: Path) -> Path:
    root = tmp_path / "private"
    folder = root / "datasets" / "digits"
    folder.mkdir(parents=True)
    (folder / "train.csv").write_text("pixel_0,label\n0,1\n")
    (folder / "test.csv").write_text("pixel_0,label\n0,1\n")
    (root / "datasets" / "half").mkdir()
    (root / "datasets" / "half" / "train.csv").write_text("pixel_0,label\n0,1\n")
    return root


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path in the tmp tree with its size and mtime: admission must add or change none of them."""
    base = root.parent
    return {
        str(p.relative_to(base)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(base.rglob("*"))
    }


def test_param_defaults_match_request_defaults() -> None:
    assert PARAM_DEFAULTS == {name: f.default for name, f in RunRequest.model_fields.items()}
    assert PARAM_DEFAULTS["project"] == "digits-ocr"
    assert PARAM_DEFAULTS["compression"] == "best"
    assert PARAM_DEFAULTS["gpu_type"] == "A100-80GB"


def test_defaults_are_admitted(estate: Estate, private_root: Path) -> None:
    before = snapshot(private_root)
    run = admit(dict(PARAM_DEFAULTS), estate, private_root)
    assert run.project == "digits-ocr" and run.team == "perception"
    assert run.dataset_path == str(private_root / "datasets" / "digits")
    assert run.workers == 2 and not run.spot_eligible and not run.must_stay_private
    assert run.request == RunRequest(**PARAM_DEFAULTS)
    assert snapshot(private_root) == before


def test_missing_params_take_defaults(estate: Estate, private_root: Path) -> None:
    assert admit({}, estate, private_root).request == RunRequest()


def test_budget_override_cleared_in_the_trigger_form_is_no_override(estate: Estate, private_root: Path) -> None:
    # The Airflow 3 form sends null for a cleared field; the Param allows null for that reason.
    from hybridflow.params import TRAINING_PARAMS

    assert "null" in TRAINING_PARAMS["budget_override"]["type"]
    assert admit({"budget_override": None}, estate, private_root).budget_override == ""


def test_full_request_and_xcom_round_trip(estate: Estate, private_root: Path) -> None:
    raw = {
        **PARAM_DEFAULTS,
        "project": "ranking",
        "sensitivity": "restricted",
        "workers": 2,
        "priority": "batch",
        "interruptible": True,
        "spot_allowed": True,
        "cluster_preference": "private",
        "train_steps": 1000,
        "checkpoint_every_steps": 1000,
        "compression": "int8",
        "deploy": False,
    }
    run = admit(raw, estate, private_root)
    assert run.team == "search" and run.must_stay_private and run.spot_eligible
    xcom = run.to_xcom()
    assert json.loads(json.dumps(xcom)) == xcom
    assert set(xcom) == set(PARAM_DEFAULTS) | {"team", "dataset_path"}
    assert AdmittedRun.from_xcom(xcom) == run
    # The pipeline stores extra keys (run_key) in the same dict; from_xcom ignores them.
    assert AdmittedRun.from_xcom({**xcom, "run_key": "r-1"}) == run


def test_admitted_run_is_frozen(estate: Estate, private_root: Path) -> None:
    run = admit({}, estate, private_root)
    with pytest.raises(ValueError):
        run.workers = 4  # type: ignore[misc]


def test_file_uri_dataset(estate: Estate, private_root: Path) -> None:
    folder = private_root / "datasets" / "digits"
    run = admit({"dataset_uri": f"file://{folder}"}, estate, private_root)
    assert run.dataset_path == str(folder)


BAD = [
    # (raw params, field at fault, a fragment the message must contain)
    ({"project": "nope"}, "project", "digits-ocr, ranking"),
    ({"project": None}, "project", "valid string"),
    ({"workers": 5}, "workers", "at most 4"),
    ({"project": "ranking", "workers": 3}, "workers", "at most 2"),
    ({"workers": 0}, "workers", "greater than or equal to 1"),
    ({"workers": "two"}, "workers", "valid integer"),
    ({"workers": True}, "workers", "whole number"),
    ({"workers": 2.5}, "workers", "fractional"),
    ({"gpu_type": "TPU-v5"}, "gpu_type", "A100-80GB"),
    ({"gpu_type": "L4"}, "gpu_type", "no cluster has L4"),
    ({"spot_allowed": True}, "spot_allowed", "set interruptible=true or spot_allowed=false"),
    ({"sensitivity": "restricted", "cluster_preference": "public"}, "cluster_preference", "never leaves"),
    ({"sensitivity": "secret"}, "sensitivity", "'restricted'"),
    ({"priority": "urgent"}, "priority", "'critical'"),
    ({"cluster_preference": "cloud"}, "cluster_preference", "'auto'"),
    ({"compression": "int4"}, "compression", "'best'"),
    ({"interruptible": "maybe"}, "interruptible", "valid boolean"),
    ({"train_steps": 100_001}, "train_steps", "100000"),
    ({"train_steps": 100, "checkpoint_every_steps": 101}, "checkpoint_every_steps", "at most 100"),
    ({"checkpoint_every_steps": 0}, "checkpoint_every_steps", "greater than or equal to 1"),
    ({"gpus": 2}, "gpus", "unknown parameter"),
    ({"zeta": 1, "alpha": 2}, "alpha", "alpha, zeta"),
    ({"dataset_uri": "private://datasets/missing"}, "dataset_uri", "does not exist"),
    ({"dataset_uri": "private://datasets/half"}, "dataset_uri", "test.csv"),
    ({"dataset_uri": "s3://bucket/digits"}, "dataset_uri", "unknown scheme"),
    ({"dataset_uri": "private://../etc"}, "dataset_uri", "not a dataset path"),
    ({"workers": -3}, "workers", "greater than or equal to 1"),
    ({"workers": 10**9}, "workers", "at most 4"),
    ({"placement_strategy": "cloud_first"}, "placement_strategy", "'elastic_first'"),
    ({"max_price_per_gpu_hour": -1}, "max_price_per_gpu_hour", "greater than or equal to 0"),
    ({"max_price_per_gpu_hour": "cheap"}, "max_price_per_gpu_hour", "valid number"),
    ({"max_price_per_gpu_hour": 0.5}, "max_price_per_gpu_hour", "cheapest 1.20"),
    ({"max_price_per_gpu_hour": 1.0, "cluster_preference": "public", "interruptible": True, "spot_allowed": True},
     "max_price_per_gpu_hour", "cheapest 1.45"),
    ({"gpu_type": "H100-80GB", "max_price_per_gpu_hour": 3.0}, "max_price_per_gpu_hour", "at least 3.90"),
]


@pytest.mark.parametrize(("raw", "field", "fragment"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_request_is_refused_by_field_without_side_effects(
    estate: Estate, private_root: Path, raw: dict, field: str, fragment: str
) -> None:
    before = snapshot(private_root)
    with pytest.raises(AdmissionError) as info:
        admit(raw, estate, private_root)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert fragment in str(info.value)
    assert snapshot(private_root) == before


def test_not_a_mapping_is_refused(estate: Estate, private_root: Path) -> None:
    with pytest.raises(AdmissionError) as info:
        admit(["workers", 2], estate, private_root)  # type: ignore[arg-type]
    assert info.value.field == "params"


def test_missing_private_root_is_not_created(estate: Estate, tmp_path: Path) -> None:
    root = tmp_path / "nowhere"
    with pytest.raises(AdmissionError) as info:
        admit({}, estate, root)
    assert info.value.field == "dataset_uri"
    assert not root.exists()


def test_team_cap_larger_than_the_gang_is_refused(tmp_path: Path, private_root: Path) -> None:
    import shutil

    target = tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", target)
    path = target / "projects.yaml"
    path.write_text(path.read_text().replace("gpu_cap: 4", "gpu_cap: 1"))
    est = load_estate(target, use_cache=False)
    with pytest.raises(AdmissionError) as info:
        admit({"project": "ranking", "workers": 2}, est, private_root)
    assert info.value.field == "workers" and "gpu_cap of 1" in str(info.value)


def _refusing_estate(tmp_path: Path) -> Estate:
    import shutil

    target = tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", target)
    path = target / "pipeline.yaml"
    path.write_text(path.read_text().replace("over_team_cap: wait", "over_team_cap: refuse"))
    return load_estate(target, use_cache=False)


@pytest.mark.parametrize("priority", ["batch", "normal"])
def test_run_past_the_team_cap_is_refused_when_configured(tmp_path: Path, private_root: Path, priority: str) -> None:
    est = _refusing_estate(tmp_path)
    before = snapshot(private_root)
    with pytest.raises(AdmissionError) as info:
        admit({"project": "ranking", "priority": priority}, est, private_root, team_usage={"search": 3})
    assert info.value.field == "priority"
    assert "holds 3 of its gpu_cap of 4" in str(info.value) and "at most 1 workers" in str(info.value)
    assert snapshot(private_root) == before
    # Within the cap, and critical runs past it, are admitted.
    assert admit({"project": "ranking", "priority": priority}, est, private_root, team_usage={"search": 2})
    assert admit({"project": "ranking", "priority": "critical"}, est, private_root, team_usage={"search": 4})


def test_team_cap_waits_by_default(estate: Estate, private_root: Path) -> None:
    # over_team_cap: wait (shipped): admit lets it in; the gang queues at admission instead.
    run = admit({"project": "ranking", "priority": "batch"}, estate, private_root, team_usage={"search": 4})
    assert run.priority == "batch"
