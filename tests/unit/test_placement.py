"""Placement: sovereignty, preference, spill threshold, spot eligibility, GPU model, tie-breaks, reasons."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from hybridflow.admission import admit
from hybridflow.config import Estate, load_estate
from hybridflow.errors import AdmissionError, PlacementError
from hybridflow.placement import PlacementDecision, choose_cluster
from hybridflow.request import AdmittedRun
from hybridflow.settings import REPO_ROOT

SHIPPED = REPO_ROOT / "config"
SPOT = {"interruptible": True, "spot_allowed": True}


@pytest.fixture(scope="module")
def estate() -> Estate:
    return load_estate(SHIPPED, use_cache=False)


@pytest.fixture
def private_root(seeded_private: Path) -> Path:
    """Private storage with the example datasets (admission reads them; nothing writes here)."""
    return seeded_private


@pytest.fixture
def run_for(estate: Estate, private_root: Path) -> Callable[..., AdmittedRun]:
    def make(estate_: Estate | None = None, **params) -> AdmittedRun:
        return admit(params, estate_ or estate, private_root)

    return make


def custom_estate(tmp_path: Path, mutate: Callable[[dict, dict, dict], None]) -> Estate:
    """The shipped config with (clusters, projects, pipeline) edited by ``mutate``."""
    target = tmp_path / "config"
    shutil.copytree(SHIPPED, target)
    names = ("clusters.yaml", "projects.yaml", "pipeline.yaml")
    docs = [yaml.safe_load((target / n).read_text()) for n in names]
    mutate(*docs)
    for name, doc in zip(names, docs, strict=True):
        (target / name).write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_estate(target, use_cache=False)


def candidate(decision: PlacementDecision, name: str) -> dict:
    return next(c for c in decision.candidates if c["cluster"] == name)


def test_default_run_goes_private_first(estate: Estate, run_for) -> None:
    d = choose_cluster(run_for(), estate, {})
    assert (d.cluster, d.location, d.node_pool) == ("onprem-a", "private", "a100")
    assert d.pricing_class == "onprem" and d.price_per_gpu_hour == pytest.approx(1.20)
    assert d.gpus == 2 and d.gpu_model == "A100-80GB" and not d.spot
    assert any("private first" in r for r in d.reasons)
    east = candidate(d, "cloud-east")
    assert not east["eligible"] and east["score"] is None
    assert any("spot only" in r for r in east["reasons"])
    assert candidate(d, "onprem-a")["rank"] == 1


def test_restricted_with_public_preference_is_refused_at_admission(run_for) -> None:
    with pytest.raises(AdmissionError) as info:
        run_for(classification="restricted", cluster_preference="public", **SPOT)
    assert info.value.field == "cluster_preference"


def test_restricted_stays_private_even_when_private_is_full(estate: Estate, run_for) -> None:
    run = run_for(classification="restricted", **SPOT)
    d = choose_cluster(run, estate, {"onprem-a": 4})
    assert d.cluster == "onprem-a" and d.location == "private"
    assert "restricted" in d.reasons[0]
    assert "dataset digits is restricted: restricted data never leaves private clusters" in candidate(
        d, "cloud-east")["reasons"]


def test_restricted_placement_refuses_forged_public_preference(estate: Estate, run_for) -> None:
    # A hand-edited XCom must not sneak restricted data onto a public cluster.
    forged = AdmittedRun.from_xcom({**run_for(**SPOT).to_xcom(), "classification": "restricted"})
    forged = forged.model_copy(update={"cluster_preference": "public"})
    with pytest.raises(PlacementError) as info:
        choose_cluster(forged, estate, {})
    assert "restricted data never leaves private clusters" in str(info.value)


@pytest.mark.parametrize(
    ("used", "expected"),
    [
        ({}, "onprem-a"),
        ({"onprem-a": 2}, "onprem-a"),
        ({"onprem-a": 3}, "cloud-east"),
        ({"onprem-a": 4}, "cloud-east"),
    ],
)
def test_auto_spills_to_public_past_threshold(estate: Estate, run_for, used: dict, expected: str) -> None:
    d = choose_cluster(run_for(**SPOT), estate, used)
    assert d.cluster == expected
    if expected == "cloud-east":
        assert (d.node_pool, d.pricing_class, d.spot) == ("a100-spot", "spot", True)
        assert d.price_per_gpu_hour == pytest.approx(1.45)
        assert any("spilling to public" in r for r in d.reasons)
        assert any("spilling" in r for r in candidate(d, "onprem-a")["reasons"])
        assert candidate(d, "onprem-a")["rank"] == 2


def test_spill_threshold_comes_from_pipeline_yaml(tmp_path: Path, run_for) -> None:
    def lower(clusters: dict, projects: dict, pipeline: dict) -> None:
        pipeline["placement"]["spill_threshold"] = 0.4

    low = custom_estate(tmp_path, lower)
    assert choose_cluster(run_for(low, **SPOT), low, {"onprem-a": 2}).cluster == "cloud-east"
    assert choose_cluster(run_for(low, **SPOT), low, {"onprem-a": 1}).cluster == "onprem-a"


def test_spill_without_public_option_queues_on_private(estate: Estate, run_for) -> None:
    d = choose_cluster(run_for(), estate, {"onprem-a": 4})
    assert d.cluster == "onprem-a"
    assert any("no public cluster is eligible" in r for r in d.reasons)


def test_spot_only_when_interruptible_and_allowed(estate: Estate, run_for) -> None:
    not_allowed = run_for(interruptible=True, cluster_preference="public")
    with pytest.raises(PlacementError) as info:
        choose_cluster(not_allowed, estate, {})
    assert "spot only" in str(info.value) and "spot_allowed=true" in str(info.value)
    d = choose_cluster(run_for(cluster_preference="public", **SPOT), estate, {})
    assert (d.cluster, d.node_pool, d.pricing_class) == ("cloud-east", "a100-spot", "spot")
    assert any("spot pool" in r for r in d.reasons)


def test_gpu_model_must_match(estate: Estate, run_for) -> None:
    d = choose_cluster(run_for(gpu_type="H100-80GB"), estate, {})
    assert (d.cluster, d.node_pool, d.pricing_class, d.spot) == (
        "cloud-east",
        "h100-on-demand",
        "on_demand",
        False,
    )
    assert d.price_per_gpu_hour == pytest.approx(3.90)
    assert any("no private cluster is eligible" in r for r in d.reasons)
    assert any("offers no H100-80GB" in r for r in candidate(d, "onprem-a")["reasons"])


def test_no_eligible_cluster_lists_every_rejection(estate: Estate, run_for) -> None:
    run = run_for(gpu_type="H100-80GB", cluster_preference="private")
    with pytest.raises(PlacementError) as info:
        choose_cluster(run, estate, {})
    message = str(info.value)
    assert "2 x H100-80GB" in message
    assert "onprem-a (private): offers no H100-80GB GPUs (has A100-80GB)" in message
    assert "cloud-east (public): cluster_preference=private" in message
    assert {c["cluster"] for c in info.value.candidates} == {"onprem-a", "cloud-east"}  # type: ignore[attr-defined]


def test_gang_must_fit_in_one_pool(tmp_path: Path, run_for) -> None:
    def bigger_quota(clusters: dict, projects: dict, pipeline: dict) -> None:
        projects["projects"]["digits-ocr"]["max_workers"] = 8

    big = custom_estate(tmp_path, bigger_quota)
    with pytest.raises(PlacementError, match="largest usable A100-80GB pool has 4 GPUs; the gang needs 6"):
        choose_cluster(run_for(big, workers=6, **SPOT), big, {})


def _two_private(clusters: dict, projects: dict, pipeline: dict) -> None:
    twin = json.loads(json.dumps(clusters["clusters"]["onprem-a"]))
    twin["prices"]["onprem"] = 0.90
    clusters["clusters"]["onprem-b"] = twin
    pipeline["placement"]["spill_threshold"] = 0.9


def test_tie_break_least_loaded_then_cheapest(tmp_path: Path, run_for) -> None:
    est = custom_estate(tmp_path, _two_private)
    run = run_for(est)
    cheap = choose_cluster(run, est, {})
    assert cheap.cluster == "onprem-b" and cheap.price_per_gpu_hour == pytest.approx(0.90)
    assert any("dearer" in r for r in candidate(cheap, "onprem-a")["reasons"])
    idle = choose_cluster(run, est, {"onprem-b": 1})
    assert idle.cluster == "onprem-a"
    assert any("busier" in r for r in candidate(idle, "onprem-b")["reasons"])
    assert any("chosen over onprem-b" in r for r in idle.reasons)


def test_exclude_fails_over_to_next_cluster(tmp_path: Path, run_for) -> None:
    est = custom_estate(tmp_path, _two_private)
    d = choose_cluster(run_for(est), est, {}, exclude={"onprem-b": "gang not admitted within 120 s"})
    assert d.cluster == "onprem-a"
    assert "excluded: gang not admitted within 120 s" in candidate(d, "onprem-b")["reasons"]


def test_decision_xcom_round_trip_and_explain(estate: Estate, run_for) -> None:
    d = choose_cluster(run_for(**SPOT), estate, {"onprem-a": 3})
    xcom = d.to_xcom()
    assert json.loads(json.dumps(xcom)) == xcom
    assert PlacementDecision.from_xcom(xcom) == d
    assert set(xcom["candidates"][0]) >= {"cluster", "eligible", "reasons", "score"}
    text = d.explain()
    assert text.startswith(
        "placement: cloud-east/a100-spot (public, spot at 1.45 USD/GPU-hour) for 2 x A100-80GB"
    )
    assert "why:" in text and "candidates:" in text and "onprem-a (private): rank 2" in text


def test_choice_is_deterministic(estate: Estate, run_for) -> None:
    run = run_for(**SPOT)
    assert choose_cluster(run, estate, {"onprem-a": 3}) == choose_cluster(run, estate, {"onprem-a": 3})


def test_odd_usage_numbers_are_clamped(estate: Estate, run_for) -> None:
    d = choose_cluster(run_for(**SPOT), estate, {"onprem-a": -5, "cloud-east": 99, "gone": 3})
    assert d.cluster == "onprem-a"
    assert candidate(d, "cloud-east")["load"] == 1.0


def test_every_candidate_records_each_rule(estate: Estate, run_for) -> None:
    d = choose_cluster(run_for(), estate, {})
    east = candidate(d, "cloud-east")["rules"]
    assert list(east) == ["excluded", "reachable", "queue", "sovereignty", "region", "preference", "gpu_model",
                          "spot", "gang_fits", "price_ceiling", "room"]
    assert east["spot"].startswith("its A100-80GB GPUs are spot only")
    assert set(candidate(d, "onprem-a")["rules"].values()) == {"pass"}


def test_elastic_first_takes_public_capacity_while_private_is_idle(estate: Estate, run_for) -> None:
    d = choose_cluster(run_for(placement_strategy="elastic_first", **SPOT), estate, {})
    assert (d.cluster, d.node_pool) == ("cloud-east", "a100-spot")
    assert any("elastic_first" in r for r in d.reasons)
    assert any("elastic_first: public clusters come first" in r for r in candidate(d, "onprem-a")["reasons"])
    # Restricted data ignores the strategy: it stays private.
    private = choose_cluster(run_for(placement_strategy="elastic_first", classification="restricted", **SPOT), estate, {})
    assert private.cluster == "onprem-a"


def test_queued_gangs_count_towards_the_spill_threshold(estate: Estate, run_for) -> None:
    run = run_for(**SPOT)
    assert choose_cluster(run, estate, {"onprem-a": 1}).cluster == "onprem-a"
    # 1 in use + 2 queued of 4 = 75 % >= 70 %: the private queue is long enough to spill.
    d = choose_cluster(run, estate, {"onprem-a": 1}, queued_gpus={"onprem-a": 2})
    assert d.cluster == "cloud-east"
    assert candidate(d, "onprem-a")["queued"] == 2


def test_queue_is_ignored_when_spill_counts_queue_is_off(tmp_path: Path, run_for) -> None:
    def off(clusters: dict, projects: dict, pipeline: dict) -> None:
        pipeline["placement"]["spill_counts_queue"] = False

    est = custom_estate(tmp_path, off)
    assert choose_cluster(run_for(est, **SPOT), est, {"onprem-a": 1}, queued_gpus={"onprem-a": 2}).cluster == "onprem-a"


def test_price_ceiling_rules_out_dearer_pools(tmp_path: Path, run_for) -> None:
    est = custom_estate(tmp_path, _two_private)  # onprem-a 1.20, onprem-b 0.90
    d = choose_cluster(run_for(est, max_price_per_gpu_hour=1.0), est, {"onprem-b": 3})
    assert d.cluster == "onprem-b"  # busier, but the only one under the ceiling
    assert "above max_price_per_gpu_hour=1" in candidate(d, "onprem-a")["rules"]["price_ceiling"]
    assert any("price ceiling of 1 USD/GPU-hour" in r for r in d.reasons)


def test_failover_history_is_part_of_the_decision(tmp_path: Path, run_for) -> None:
    est = custom_estate(tmp_path, _two_private)
    d = choose_cluster(run_for(est), est, {}, exclude={"onprem-b": "gang not admitted within 120 s"})
    assert d.failovers == [{"cluster": "onprem-b", "reason": "gang not admitted within 120 s"}]
    assert "failed over from:\n  - onprem-b: gang not admitted within 120 s" in d.explain()


def test_a_restricted_dataset_with_default_params_stays_private(estate: Estate, run_for) -> None:
    # The classification comes from the catalogue: breast-cancer is restricted there, so a run with
    # default Params (auto, local_first) never spills it, however busy the private pool is.
    run = run_for(model="breast-cancer", **SPOT)
    assert run.classification == "restricted"
    d = choose_cluster(run, estate, {"onprem-a": 4}, queued_gpus={"onprem-a": 8})
    assert d.cluster == "onprem-a"
    assert candidate(d, "cloud-east")["rules"]["sovereignty"].startswith("dataset breast-cancer is restricted")


def _eu_estate(tmp_path: Path) -> Estate:
    """The shipped estate plus an EU cloud, with the digits dataset limited to the EU."""

    def mutate(clusters: dict, projects: dict, pipeline: dict) -> None:
        eu = json.loads(json.dumps(clusters["clusters"]["cloud-east"]))
        eu.update(region="eu-west-1", jurisdiction="eu",
                  cache={"conn_id": "hybridflow_cache_cloud_eu", "bucket": "hf-cache-cloud-eu"})
        clusters["clusters"]["cloud-eu"] = eu

    estate = custom_estate(tmp_path, mutate)
    path = estate.config_dir / "datasets.yaml"
    body = yaml.safe_load(path.read_text())
    body["datasets"]["digits"]["regions"] = ["eu"]
    path.write_text(yaml.safe_dump(body))
    return load_estate(estate.config_dir, use_cache=False)


def test_an_eu_only_dataset_is_placed_in_the_eu(tmp_path: Path, run_for) -> None:
    est = _eu_estate(tmp_path)
    run = run_for(est, cluster_preference="public", **SPOT)
    assert run.regions == ["eu"]
    d = choose_cluster(run, est, {})
    assert d.cluster == "cloud-eu"
    east = candidate(d, "cloud-east")
    assert not east["eligible"]
    assert east["rules"]["region"] == "dataset digits may only be processed in eu; the cluster is in us-east-1 / us"
    assert any("stays in eu: cloud-eu is in eu-west-1 / eu" in r for r in d.reasons)
    # Even when the EU cloud cannot take it, the US one is never the answer.
    with pytest.raises(PlacementError, match="may only be processed in eu"):
        choose_cluster(run, est, {}, exclude={"cloud-eu": "gang not admitted"})


# -- what the clusters report: reachability, room now, team queues ---------------------------------
def test_an_unreachable_cluster_is_never_chosen_and_the_explanation_says_why(estate: Estate, run_for) -> None:
    from hybridflow.backends.base import ClusterLoad
    from hybridflow.placement import place

    loads = {"onprem-a": ClusterLoad.unknown("onprem-a", 4, "Connection k8s_dc2: connection refused"),
             "cloud-east": ClusterLoad("cloud-east", 8)}
    d = place(run_for(**SPOT), estate, loads)
    assert d.cluster == "cloud-east"  # private would win on an idle estate; it cannot be read
    assert "connection refused" in candidate(d, "onprem-a")["rules"]["reachable"]
    assert "not chosen until the cluster answers" in d.explain()
    with pytest.raises(PlacementError, match="onprem-a .*usage and queue unknown"):
        place(run_for(classification="restricted"), estate, loads)  # restricted: nowhere else to go


def test_moving_a_waiting_gang_only_goes_where_it_would_start_now(estate: Estate, run_for) -> None:
    run = run_for(**SPOT)
    d = choose_cluster(run, estate, {"cloud-east": 0}, exclude={"onprem-a": "waited"}, require_room=True)
    assert d.cluster == "cloud-east"
    with pytest.raises(PlacementError, match="no room now: 8/8 GPUs in use"):
        choose_cluster(run, estate, {"cloud-east": 8}, exclude={"onprem-a": "waited"}, require_room=True)
    with pytest.raises(PlacementError, match="2 queued"):
        choose_cluster(run, estate, {}, queued_gpus={"cloud-east": 2}, exclude={"onprem-a": "waited"},
                       require_room=True)


def test_a_team_queue_missing_on_a_cluster_rules_it_out_naming_the_fix(estate: Estate, run_for) -> None:
    run = run_for(**SPOT)
    d = choose_cluster(run, estate, {}, queues={"onprem-a": frozenset({"other-team"})})
    assert d.cluster == "cloud-east"
    why = candidate(d, "onprem-a")["rules"]["queue"]
    assert f"queue {estate.queue_of(run.team)!r} does not exist" in why and f"teams.{run.team}.queue" in why


# -- start_by: the cheapest cluster expected to start in time -------------------------------------
def test_start_by_picks_the_cheaper_cluster_when_history_says_it_starts_in_time(estate: Estate, run_for) -> None:
    from hybridflow.waits import WaitEstimate

    run = run_for(start_by="2h", **SPOT)
    busy = {"onprem-a": 4}  # private full: the usual rules spill to public
    assert choose_cluster(run, estate, busy).cluster == "cloud-east"
    waits = {"onprem-a": WaitEstimate("onprem-a", 1800, "p80 of 12 waits of 1-4 GPU gangs on onprem-a", 12),
             "cloud-east": WaitEstimate("cloud-east", 0, "room now", 0)}
    d = choose_cluster(run, estate, busy, waits=waits)
    assert d.cluster == "onprem-a" and d.price_per_gpu_hour < candidate(d, "cloud-east")["price_per_gpu_hour"]
    assert "cheapest cluster expected to start in time" in d.reasons[0]
    assert any("p80 of 12 waits" in r for r in d.reasons)
    assert candidate(d, "onprem-a")["wait_estimate"]["seconds"] == 1800
    # History says the private wait is longer than the deadline: the cluster that starts in time wins.
    late = {**waits, "onprem-a": WaitEstimate("onprem-a", 3 * 3600, "p80 of 12 waits", 12)}
    assert choose_cluster(run, estate, busy, waits=late).cluster == "cloud-east"


def test_start_by_without_history_says_so_and_keeps_the_usual_rules(estate: Estate, run_for) -> None:
    from hybridflow.waits import WaitEstimate

    run = run_for(start_by="30m", **SPOT)
    unknown = {n: WaitEstimate(n, None, f"no history: only 0 waits on {n}") for n in ("onprem-a", "cloud-east")}
    d = choose_cluster(run, estate, {"onprem-a": 4}, waits=unknown)
    assert d.cluster == "cloud-east"  # spilled, as without start_by
    assert any("no wait estimate" in r for r in d.reasons)


@pytest.mark.parametrize("value", ["-2h", "soon", "0", "P1M"])
def test_a_bad_start_by_is_refused_at_admission_naming_the_field(run_for, value: str) -> None:
    with pytest.raises(AdmissionError) as err:
        run_for(start_by=value)
    assert err.value.field == "start_by" and "2h" in str(err.value)
