"""Admission: good requests become an AdmittedRun with every default resolved from the catalogue and
the registry; every bad one is refused by field, naming the fix, with no side effects."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from hybridflow.admission import PARAM_DEFAULTS, admit
from hybridflow.config import Estate, load_estate
from hybridflow.errors import AdmissionError
from hybridflow.request import AdmittedRun, RunRequest
from hybridflow.settings import REPO_ROOT


@pytest.fixture(scope="module")
def estate() -> Estate:
    return load_estate(REPO_ROOT / "config", use_cache=False)


@pytest.fixture
def private_root(seeded_private: Path, tmp_path: Path) -> Path:
    """A copy of the seeded examples a test may break (admission itself must never write to it)."""
    root = tmp_path / "private"
    shutil.copytree(seeded_private, root)
    return root


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path in the tmp tree with its size and mtime: admission must add or change none of them."""
    base = root.parent
    return {str(p.relative_to(base)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(base.rglob("*"))}


def estate_with(tmp_path: Path, edits: dict[str, Callable[[dict], None]]) -> Estate:
    """The shipped config copied to ``tmp_path/config`` with each file's YAML edited in place."""
    target = tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", target)
    for name, edit in edits.items():
        body = yaml.safe_load((target / name).read_text())
        edit(body)
        (target / name).write_text(yaml.safe_dump(body))
    return load_estate(target, use_cache=False)


def test_param_defaults_match_request_defaults() -> None:
    assert PARAM_DEFAULTS == {name: f.default for name, f in RunRequest.model_fields.items()}
    assert PARAM_DEFAULTS["model"] is None and PARAM_DEFAULTS["dataset"] is None  # from the registry, not the form
    assert PARAM_DEFAULTS["compression"] == "best"


def test_defaults_are_admitted_from_the_registry_and_catalogue(estate: Estate, private_root: Path) -> None:
    before = snapshot(private_root)
    run = admit(dict(PARAM_DEFAULTS), estate, private_root)
    model = estate.models.get(estate.pipeline.defaults.model)
    assert run.model == model.name and run.dataset == model.dataset and run.project == model.project
    assert run.team == estate.projects[model.project].team
    assert run.classification == estate.datasets.get(model.dataset).effective_classification
    assert run.hyperparameters == model.defaults()
    assert run.dataset_location == (private_root / "datasets" / model.dataset).resolve().as_uri()
    assert snapshot(private_root) == before


def test_missing_params_take_defaults(estate: Estate, private_root: Path) -> None:
    assert admit({}, estate, private_root) == admit(dict(PARAM_DEFAULTS), estate, private_root)


def test_the_data_owns_its_classification(estate: Estate, private_root: Path) -> None:
    # breast-cancer is restricted in the catalogue: a run with default Params handles it as restricted.
    run = admit({"model": "breast-cancer"}, estate, private_root)
    assert run.classification == "restricted" and run.must_stay_private
    assert run.project == "diagnosis" and run.hyperparameters["steps"] == 200
    # A run may raise it for itself.
    raised = admit({"classification": "restricted"}, estate, private_root)
    assert raised.classification == "restricted" and raised.must_stay_private


def test_an_unclassified_dataset_is_restricted(tmp_path: Path, private_root: Path) -> None:
    est = estate_with(tmp_path, {"datasets.yaml": lambda b: b["datasets"]["digits"].pop("classification")})
    assert admit({}, est, private_root).classification == "restricted"
    with pytest.raises(AdmissionError) as info:
        admit({"classification": "internal"}, est, private_root)
    assert info.value.field == "classification" and "unclassified" in str(info.value)


def test_cleared_form_fields_are_defaults(estate: Estate, private_root: Path) -> None:
    # The Airflow 3 form sends null (or "") for a cleared field; those Params allow null for that reason.
    from hybridflow.params import TRAINING_PARAMS

    for name in ("model", "dataset", "project", "classification", "regions", "budget_override"):
        assert "null" in TRAINING_PARAMS[name]["type"], name
    run = admit({"model": "", "dataset": None, "budget_override": None, "regions": None}, estate, private_root)
    assert run.budget_override == "" and run.model == estate.pipeline.defaults.model


def test_full_request_and_xcom_round_trip(estate: Estate, private_root: Path) -> None:
    raw = {
        **PARAM_DEFAULTS,
        "model": "digits-mlp",
        "project": "ranking",
        "classification": "restricted",
        "regions": ["eu"],
        "hyperparameters": {"steps": 1000, "learning_rate": 1},
        "workers": 2,
        "priority": "batch",
        "interruptible": True,
        "spot_allowed": True,
        "cluster_preference": "private",
        "checkpoint_every_steps": 1000,
        "compression": "int8",
        "deploy": False,
    }
    run = admit(raw, estate, private_root)
    assert run.team == "search" and run.must_stay_private and run.spot_eligible
    assert run.regions == ["eu"]
    assert run.hyperparameters["steps"] == 1000 and run.hyperparameters["learning_rate"] == 1.0
    assert isinstance(run.hyperparameters["learning_rate"], float)  # an int given for a float is widened
    xcom = run.to_xcom()
    assert json.loads(json.dumps(xcom)) == xcom
    assert set(xcom) == set(PARAM_DEFAULTS) | {"team", "dataset_location"}
    assert AdmittedRun.from_xcom(xcom) == run
    # The pipeline stores extra keys (run_key) in the same dict; from_xcom ignores them.
    assert AdmittedRun.from_xcom({**xcom, "run_key": "r-1"}) == run


def test_admitted_run_is_frozen(estate: Estate, private_root: Path) -> None:
    run = admit({}, estate, private_root)
    with pytest.raises(ValueError):
        run.workers = 4  # type: ignore[misc]


BAD = [
    # (raw params, field at fault, a fragment the message must contain)
    ({"model": "resnet"}, "model", "digits-mlp"),
    ({"dataset": "imagenet"}, "dataset", "breast-cancer, digits"),
    ({"dataset": "breast-cancer"}, "dataset", "cannot train on dataset breast-cancer"),
    ({"project": "nope"}, "project", "diagnosis, digits-ocr, ranking"),
    ({"model": "breast-cancer", "classification": "internal"}, "classification", "never lower it"),
    ({"classification": "public"}, "classification", "internal or restricted"),
    ({"classification": "secret"}, "classification", "'restricted'"),
    ({"regions": ["mars"]}, "regions", "unknown region 'mars'"),
    ({"hyperparameters": {"steps": "many"}}, "hyperparameters.steps", "whole number"),
    ({"hyperparameters": {"steps": 0}}, "hyperparameters.steps", "below the minimum 1"),
    ({"hyperparameters": {"steps": True}}, "hyperparameters.steps", "whole number"),
    ({"hyperparameters": {"lr": 0.1}}, "hyperparameters", "no hyper-parameter 'lr'"),
    ({"hyperparameters": {"momentum": 2}}, "hyperparameters.momentum", "above the maximum 1"),
    ({"workers": 5}, "workers", "at most 4"),
    ({"project": "ranking", "workers": 3}, "workers", "at most 2"),
    ({"workers": 0}, "workers", "greater than or equal to 1"),
    ({"workers": "two"}, "workers", "valid integer"),
    ({"workers": True}, "workers", "whole number"),
    ({"workers": 2.5}, "workers", "fractional"),
    ({"gpu_type": "TPU-v5"}, "gpu_type", "A100-80GB"),
    ({"gpu_type": "L4"}, "gpu_type", "no cluster has L4"),
    ({"spot_allowed": True}, "spot_allowed", "set interruptible=true or spot_allowed=false"),
    ({"model": "breast-cancer", "cluster_preference": "public"}, "cluster_preference", "never leaves"),
    ({"classification": "restricted", "cluster_preference": "public"}, "cluster_preference", "never leaves"),
    ({"priority": "urgent"}, "priority", "'critical'"),
    ({"cluster_preference": "cloud"}, "cluster_preference", "'auto'"),
    ({"compression": "int4"}, "compression", "'best'"),
    ({"interruptible": "maybe"}, "interruptible", "valid boolean"),
    ({"checkpoint_every_steps": 0}, "checkpoint_every_steps", "greater than or equal to 1"),
    ({"gpus": 2}, "gpus", "unknown parameter"),
    ({"zeta": 1, "alpha": 2}, "alpha", "alpha, zeta"),
    ({"dataset_uri": "private://datasets/digits"}, "dataset_uri", "unknown parameter"),
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
    assert info.value.field == "dataset" and "does not exist" in str(info.value)
    assert not root.exists()


# -- the data and the code, checked before anything runs -----------------------------------------------
def _refused(est: Estate, root: Path, raw: dict | None = None, **kwargs) -> AdmissionError:
    before = snapshot(root)
    with pytest.raises(AdmissionError) as info:
        admit(raw or {}, est, root, **kwargs)
    assert snapshot(root) == before
    return info.value


def test_a_suite_file_that_is_not_a_gx_suite_is_refused(estate: Estate, private_root: Path) -> None:
    suite = private_root / "datasets" / "digits" / "expectations" / "train.json"
    suite.write_text(json.dumps({"name": "x", "expectations": [{"type": "expect_the_unexpected", "kwargs": {}}]}))
    err = _refused(estate, private_root)
    assert err.field == "dataset" and "expect_the_unexpected" in str(err) and "train.json" in str(err)
    suite.write_text("not json")
    assert "train.json" in str(_refused(estate, private_root))
    suite.unlink()
    assert "does not exist" in str(_refused(estate, private_root))


def test_data_that_does_not_match_the_schema_is_refused(tmp_path: Path, private_root: Path) -> None:
    # The catalogue says a column is text while the CSV holds numbers.
    def stringly(body: dict) -> None:
        body["datasets"]["digits"]["schema"][1]["type"] = "string"

    err = _refused(estate_with(tmp_path, {"datasets.yaml": stringly}), private_root)
    assert err.field == "dataset" and "column label holds int values, the schema says string" in str(err)

    # A Parquet file with a column the schema does not list.
    import pandas as pd

    path = private_root / "datasets" / "breast-cancer" / "test.parquet"
    frame = pd.read_parquet(path)
    frame["patient_name"] = "x"
    frame.to_parquet(path)
    est = load_estate(REPO_ROOT / "config", use_cache=False)
    err = _refused(est, private_root, {"model": "breast-cancer"})
    assert "patient_name" in str(err) and "test.parquet" in str(err)


def test_a_split_without_files_is_refused(estate: Estate, private_root: Path) -> None:
    (private_root / "datasets" / "digits" / "test.csv").unlink()
    err = _refused(estate, private_root)
    assert err.field == "dataset" and "no file matches 'test.csv'" in str(err)


def _module(tmp_path: Path, monkeypatch, source: str) -> None:
    import sys

    pkg = tmp_path / "code" / "team_models"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    for name in ("team_models", "team_models.bad", "team_models.missing"):  # each case imports afresh
        monkeypatch.delitem(sys.modules, name, raising=False)


@pytest.mark.parametrize(
    ("entrypoint", "source", "fragment"),
    [
        ("team_models.missing:train", "", "does not import"),
        ("team_models.bad:train", "import no_such_dependency\n", "No module named 'no_such_dependency'"),
        ("team_models.bad:train", "def fit(ctx):\n    pass\n", "has no function 'train'"),
        ("team_models.bad:train", "def train(ctx, data):\n    pass\n", "cannot be called with one argument"),
        ("team_models.bad:train", "def train():\n    pass\n", "def train(ctx)"),
    ],
)
def test_an_entrypoint_that_cannot_be_called_is_refused(
    tmp_path: Path, private_root: Path, monkeypatch, entrypoint: str, source: str, fragment: str
) -> None:
    _module(tmp_path, monkeypatch, source)

    def point(body: dict) -> None:
        body["models"]["digits-mlp"]["entrypoint"] = entrypoint

    err = _refused(estate_with(tmp_path, {"models.yaml": point}), private_root)
    assert err.field == "model" and "models.digits-mlp.entrypoint" in str(err) and fragment in str(err)


def test_file_datasets_are_limited_to_the_configured_roots(tmp_path: Path, private_root: Path) -> None:
    outside = tmp_path / "elsewhere" / "digits"
    shutil.copytree(private_root / "datasets" / "digits", outside)
    roots = tmp_path / "roots"
    (roots / "ok").mkdir(parents=True)
    shutil.copytree(outside, roots / "ok" / "digits")
    os.symlink(outside, roots / "ok" / "linked")

    def at(uri: str):
        def edit(body: dict) -> None:
            body["datasets"]["digits"]["location"] = uri
        return edit

    est = estate_with(tmp_path / "a", {"datasets.yaml": at(f"file://{roots / 'ok' / 'digits'}")})
    run = admit({}, est, private_root, file_roots=[roots / "ok"])
    assert run.dataset_location == (roots / "ok" / "digits").as_uri()
    # Without the root configured, the same folder is refused, naming the setting.
    err = _refused(est, private_root)
    assert err.field == "dataset" and "data.file_roots" in str(err)
    # A folder outside every root, and a symlink inside a root that leads out of it.
    err = _refused(estate_with(tmp_path / "b", {"datasets.yaml": at(f"file://{outside}")}), private_root,
                   file_roots=[roots / "ok"])
    assert "outside data.file_roots" in str(err)
    err = _refused(estate_with(tmp_path / "c", {"datasets.yaml": at(f"file://{roots / 'ok' / 'linked'}")}),
                   private_root, file_roots=[roots / "ok"])
    assert "through a symlink" in str(err) and str(outside) in str(err)


def test_a_private_dataset_cannot_link_out_of_private_storage(estate: Estate, private_root: Path, tmp_path: Path) -> None:
    folder = private_root / "datasets" / "digits"
    moved = tmp_path / "outside-digits"
    shutil.move(folder, moved)
    os.symlink(moved, folder)
    err = _refused(estate, private_root)
    assert err.field == "dataset" and "outside private storage" in str(err)


def test_regions_may_narrow_never_widen(tmp_path: Path, private_root: Path) -> None:
    def eu_only(body: dict) -> None:
        body["datasets"]["digits"]["regions"] = ["eu"]

    est = estate_with(tmp_path, {"datasets.yaml": eu_only})
    assert admit({}, est, private_root).regions == ["eu"]
    assert admit({"regions": ["dc-1"]}, est, private_root).regions == ["dc-1"]  # a region within eu
    err = _refused(est, private_root, {"regions": ["us"]})
    assert err.field == "regions" and "never widen" in str(err)


def test_unknown_region_in_the_catalogue_is_a_config_error(tmp_path: Path) -> None:
    from hybridflow.errors import ConfigError

    def typo(body: dict) -> None:
        body["datasets"]["digits"]["regions"] = ["ue"]

    with pytest.raises(ConfigError, match=r"datasets.digits.regions\[0\]: unknown region 'ue'"):
        estate_with(tmp_path, {"datasets.yaml": typo})


# -- caps ----------------------------------------------------------------------------------------------
def test_team_cap_larger_than_the_gang_is_refused(tmp_path: Path, private_root: Path) -> None:
    def cap(body: dict) -> None:
        body["teams"]["search"]["gpu_cap"] = 1

    est = estate_with(tmp_path, {"projects.yaml": cap})
    err = _refused(est, private_root, {"project": "ranking", "workers": 2})
    assert err.field == "workers" and "gpu_cap of 1" in str(err)


def _refusing_estate(tmp_path: Path) -> Estate:
    return estate_with(tmp_path, {"pipeline.yaml": lambda b: b["admission"].update(over_team_cap="refuse")})


@pytest.mark.parametrize("priority", ["batch", "normal"])
def test_run_past_the_team_cap_is_refused_when_configured(tmp_path: Path, private_root: Path, priority: str) -> None:
    est = _refusing_estate(tmp_path)
    err = _refused(est, private_root, {"project": "ranking", "priority": priority}, team_usage={"search": 3})
    assert err.field == "priority"
    assert "holds 3 of its gpu_cap of 4" in str(err) and "at most 1 workers" in str(err)
    # Within the cap, and critical runs past it, are admitted.
    assert admit({"project": "ranking", "priority": priority}, est, private_root, team_usage={"search": 2})
    assert admit({"project": "ranking", "priority": "critical"}, est, private_root, team_usage={"search": 4})


def test_team_cap_waits_by_default(estate: Estate, private_root: Path) -> None:
    # over_team_cap: wait (shipped): admit lets it in; the gang queues at admission instead.
    run = admit({"project": "ranking", "priority": "batch"}, estate, private_root, team_usage={"search": 4})
    assert run.priority == "batch"
