"""The reason a cluster is declared down with is capped on the server: the cluster_fence task and
the CLI refuse a longer one, naming the argument and the limit, before they fence or drain anything."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.dr_config import config_with_dr

from hybridflow.fencing import down_clusters

_config = config_with_dr


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(_config(tmp_path)))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_reason_over_the_cap_is_refused_before_anything_is_fenced(home: Path):
    from airflow.sdk.exceptions import AirflowFailException

    from hybridflow.dr.fencing.task import fence_task

    with pytest.raises(AirflowFailException) as refused:
        fence_task({"action": "down", "cluster": "onprem-a", "reason": "x" * 501}, by="mallory")
    assert str(refused.value).startswith("cluster down: reason: 501 characters, over the limit of 500")
    assert not (home / "state" / "fencing.json").exists()  # not fenced, nothing drained, no history
    assert not (home / "state").exists() or not any((home / "state").rglob("*.json"))


def test_the_cli_refuses_a_reason_over_the_cap_too(home: Path, capsys):
    from hybridflow.cli import main

    assert main(["cluster", "down", "onprem-a", "--reason", "x" * 501]) != 0
    assert "reason: 501 characters, over the limit of 500" in capsys.readouterr().err
    assert not (home / "state" / "fencing.json").exists()


def test_a_reason_at_the_cap_is_kept_whole(home: Path):
    from hybridflow.dr.fencing.task import fence_task

    reason = "power loss in dc-1; " + "y" * 480
    assert len(reason) == 500
    out = fence_task({"action": "down", "cluster": "onprem-a", "reason": reason}, by="ops")
    assert out["changed"]
    assert down_clusters(home / "state" / "fencing.json")["onprem-a"]["reason"] == reason


def test_the_trigger_form_s_param_refuses_a_longer_reason_too():
    from airflow.sdk import Param
    from airflow.sdk.definitions.param import ParamValidationError

    from hybridflow.dr.fencing.task import FENCE_PARAMS, REASON_MAX_CHARS

    param = Param(**FENCE_PARAMS["reason"])
    assert param.resolve("z" * REASON_MAX_CHARS) == "z" * REASON_MAX_CHARS
    with pytest.raises(ParamValidationError):
        param.resolve("z" * (REASON_MAX_CHARS + 1))
