"""The estate config: the shipped files load; broken copies fail naming file, key path and fix."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from tests.support.k8s_config import as_kubernetes

from hybridflow.config import load_estate
from hybridflow.errors import ConfigError
from hybridflow.settings import REPO_ROOT

SHIPPED = REPO_ROOT / "config"


def broken_copy(tmp_path: Path, filename: str, mutate: Callable[[dict], None]) -> Path:
    """Copy the shipped config to tmp_path and apply ``mutate`` to one file's parsed YAML."""
    target = tmp_path / "config"
    shutil.copytree(SHIPPED, target)
    data = yaml.safe_load((target / filename).read_text())
    mutate(data)
    (target / filename).write_text(yaml.safe_dump(data, sort_keys=False))
    return target


def test_shipped_config_loads() -> None:
    estate = load_estate(SHIPPED, use_cache=False)
    assert set(estate.clusters) >= {"onprem-a", "cloud-east"}
    onprem, cloud = estate.clusters["onprem-a"], estate.clusters["cloud-east"]
    assert onprem.name == "onprem-a" and onprem.is_private and onprem.checkpoint_store == "private"
    assert cloud.location == "public" and cloud.cache is not None and cloud.checkpoint_store == "cache"
    assert onprem.total_gpus == 4 and cloud.total_gpus == 8
    assert cloud.gpu_models == ["A100-80GB", "H100-80GB"]
    assert cloud.gpus_of("A100-80GB") == 4
    assert cloud.gpus_of("A100-80GB", spot=True) == 4
    assert cloud.gpus_of("A100-80GB", spot=False) == 0
    assert cloud.gpus_of("H100-80GB", spot=False) == 4
    assert cloud.price_of(cloud.pool("a100-spot")) == pytest.approx(1.45)
    assert cloud.pricing_class(cloud.pool("h100-on-demand")) == "on_demand"
    assert onprem.pricing_class(onprem.pool("a100")) == "onprem"
    assert estate.projects["digits-ocr"].team == "perception"
    assert estate.projects["ranking"].max_workers == 2
    assert "L4" in estate.gpu_types
    assert estate.pipeline.placement.spill_threshold == pytest.approx(0.7)
    assert estate.pipeline.training.checkpoint_keep == 3
    assert estate.offered_gpu_models() == ["A100-80GB", "H100-80GB"]


def test_cache_returns_same_estate_until_a_file_changes(tmp_path: Path) -> None:
    target = tmp_path / "config"
    shutil.copytree(SHIPPED, target)
    first = load_estate(target)
    assert load_estate(target) is first
    path = target / "projects.yaml"
    path.write_text(path.read_text().replace("max_workers: 2", "max_workers: 3"))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    second = load_estate(target)
    assert second is not first
    assert second.projects["ranking"].max_workers == 3


def _set(path: list, value) -> Callable[[dict], None]:
    def mutate(data: dict) -> None:
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return mutate


def _delete(path: list) -> Callable[[dict], None]:
    def mutate(data: dict) -> None:
        node = data
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return mutate


def _no_private(data: dict) -> None:
    data["clusters"]["onprem-a"]["location"] = "public"
    data["clusters"]["onprem-a"]["prices"] = {"on_demand": 2.0}
    data["clusters"]["onprem-a"]["cache"] = {"conn_id": "c", "bucket": "b"}


BROKEN = [
    # (file, mutation, substrings the message must contain)
    (
        "clusters.yaml",
        _set(["clusters", "cloud-east", "node_pools", 0, "gpus"], 0),
        ["clusters.cloud-east.node_pools[0].gpus", "greater than 0"],
    ),
    (
        "clusters.yaml",
        _set(["clusters", "onprem-a", "location"], "hybrid"),
        ["clusters.onprem-a.location", "'private' or 'public'"],
    ),
    (
        "clusters.yaml",
        _set(["clusters", "onprem-a", "node_pools", 0, "gpu"], 4),
        ["clusters.onprem-a.node_pools[0].gpu", "unknown key", "allowed keys here", "gpu_model"],
    ),
    (
        "clusters.yaml",
        _delete(["clusters", "onprem-a", "region"]),
        ["clusters.onprem-a.region", "add `region"],
    ),
    (
        "clusters.yaml",
        _delete(["clusters", "cloud-east", "cache"]),
        ["clusters.cloud-east.cache", "public cluster"],
    ),
    (
        "clusters.yaml",
        _set(["clusters", "onprem-a", "checkpoint_store"], "cache"),
        ["clusters.onprem-a.checkpoint_store", "'private'"],
    ),
    (
        "clusters.yaml",
        _set(["clusters", "onprem-a", "node_pools", 0, "gpu_model"], "B200"),
        ["clusters.onprem-a.node_pools[0].gpu_model", "'B200'", "gpu_types", "projects.yaml"],
    ),
    (
        "clusters.yaml",
        _set(["clusters", "onprem-a", "node_pools", 0, "gpu_memory_gib"], 40),
        ["clusters.onprem-a.node_pools[0].gpu_memory_gib", "make them equal"],
    ),
    ("clusters.yaml", _no_private, ["clusters", "location: private", "add at least one"]),
    (
        "clusters.yaml",
        _delete(["clusters", "cloud-east", "prices", "spot"]),
        ["clusters.cloud-east.prices", "spot"],
    ),
    (
        "clusters.yaml",
        _set(["clusters", "onprem-a", "prices", "onprem"], -1),
        ["clusters.onprem-a.prices.onprem", "greater than or equal to 0"],
    ),
    (
        "clusters.yaml",
        _set(["clusters", "onprem-a", "prices", "discount"], 0.5),
        ["clusters.onprem-a.prices.discount", "onprem"],
    ),
    (
        "clusters.yaml",
        _set(["clusters", "onprem-a", "backend"], "kubernetes"),
        ["clusters.onprem-a.conn_id", "clusters.onprem-a.scheduler", "volcano or kueue"],
    ),
    (
        "clusters.yaml",
        _set(["clusters", "onprem-a", "scheduler"], "volcano"),
        ["clusters.onprem-a.scheduler", "backend: kubernetes"],
    ),
    (
        "clusters.yaml",
        _set(["clusters", "onprem-a", "node_pools", 0, "spot"], True),
        ["clusters.onprem-a.node_pools[0].spot", "public clusters"],
    ),
    ("clusters.yaml", _set(["clusters", "Bad_Name"], None), ["clusters.Bad_Name"]),
    (
        "projects.yaml",
        _set(["projects", "ranking", "team"], "ads"),
        ["projects.ranking.team", "'ads'", "perception, search"],
    ),
    ("projects.yaml", _set(["projects", "ranking", "max_workers"], 0), ["projects.ranking.max_workers"]),
    ("projects.yaml", _set(["gpu_types", "L4", "memory_gib"], "lots"), ["gpu_types.L4.memory_gib", "'lots'"]),
    ("pipeline.yaml", _set(["placement", "spill_threshold"], 1.5), ["placement.spill_threshold", "1.5"]),
    ("pipeline.yaml", _set(["placement", "spill"], 0.5), ["placement.spill", "spill_threshold"]),
    ("pipeline.yaml", _set(["serving", "port"], 70000), ["serving.port", "65535"]),
    ("pipeline.yaml", _set(["admission", "over_team_cap"], "queue"), ["admission.over_team_cap", "'wait'", "'refuse'"]),
    ("pipeline.yaml", _set(["admission", "critical_preempts_batch"], "sometimes"),
     ["admission.critical_preempts_batch", "valid boolean"]),
    ("pipeline.yaml", _set(["placement", "spill_counts_queue"], "maybe"), ["placement.spill_counts_queue", "valid boolean"]),
    ("pipeline.yaml", _set(["training", "gang_admission_timeout_s"], 0), ["training.gang_admission_timeout_s", "greater than 0"]),
    ("pipeline.yaml", _set(["training", "max_queue_wait_s"], -1), ["training.max_queue_wait_s", "greater than or equal to 0"]),
    ("pipeline.yaml", _set(["placement", "cluster_read_timeout_s"], 0), ["placement.cluster_read_timeout_s", "greater than 0"]),
    (
        "clusters.yaml",
        _set(["clusters", "onprem-a", "node_pools", 0, "pricing"], "spot"),
        ["clusters.onprem-a.node_pools[0].pricing", "onprem, reserved"],
    ),
    (
        "clusters.yaml",
        _set(["clusters", "onprem-a", "node_pools", 0, "node_labels"], {"pool": "a100"}),
        ["clusters.onprem-a.node_pools[0].node_labels", "backend: kubernetes"],
    ),
    (
        "clusters.yaml",
        _set(["clusters", "onprem-a", "namespace"], "ml"),
        ["clusters.onprem-a.namespace", "backend: kubernetes"],
    ),
    (
        "projects.yaml",
        _set(["teams", "search", "guaranteed_share"], 0.75),
        ["teams: guaranteed_share adds up to 1.25", "at most 1.0"],
    ),
    ("projects.yaml", _set(["teams", "search", "gpu_cap"], 0), ["teams.search.gpu_cap"]),
    (
        "projects.yaml",
        _set(["teams", "search", "queue"], "perception"),
        ["teams.search.queue", "'perception'", "own"],
    ),
]


def _k8s(**change) -> Callable[[dict], None]:
    """onprem-a as a valid kubernetes cluster, then ``change`` (None removes a key)."""

    def mutate(data: dict) -> None:
        cluster = as_kubernetes(data["clusters"]["onprem-a"], conn_id="k8s_a", scheduler="volcano")
        for key, value in change.items():
            if value is None:
                cluster.pop(key, None)
            else:
                cluster[key] = value

    return mutate


BROKEN += [
    ("clusters.yaml", _k8s(image=None), ["clusters.onprem-a.image", "training image"]),
    ("clusters.yaml", _k8s(cache=None, checkpoint_store="scratch", checkpoint_replica=None),
     ["clusters.onprem-a.cache", "pods read staged data"]),
    ("clusters.yaml", _k8s(checkpoint_replica="private"),
     ["clusters.onprem-a.checkpoint_replica", "cannot reach private storage", "'scratch'"]),
    ("clusters.yaml", _k8s(scratch_claim=None), ["clusters.onprem-a.scratch_claim", "PersistentVolumeClaim"]),
    ("clusters.yaml", _k8s(scratch_dir="scratch/onprem-a"), ["clusters.onprem-a.scratch_dir", "absolute path"]),
    ("clusters.yaml", _set(["clusters", "onprem-a", "image"], "trainer:1"),
     ["clusters.onprem-a.image", "backend: kubernetes"]),
    ("clusters.yaml", _k8s(nccl_socket_ifname="eth0 eth1"),
     ["clusters.onprem-a.nccl_socket_ifname", "'eth0 eth1'", "e.g. eth0 or ^lo,docker"]),
    ("clusters.yaml", _k8s(nccl_socket_ifname="a-name-longer-than-15"), ["clusters.onprem-a.nccl_socket_ifname"]),
    ("clusters.yaml", _set(["clusters", "onprem-a", "nccl_socket_ifname"], "eth0"),
     ["clusters.onprem-a.nccl_socket_ifname", "backend: kubernetes"]),
    ("pipeline.yaml", _set(["serving", "kubernetes"], {
        "cluster": "onprem-a", "node_pool": "a100", "image": "serve:1", "models_claim": "models",
        "models_dir": "/models"}), ["serving.kubernetes.cluster", "'onprem-a'", "backend kubernetes"]),
    ("pipeline.yaml", _set(["serving", "kubernetes"], {"cluster": "onprem-a", "image": "serve:1"}),
     ["serving.kubernetes.node_pool: required key is missing", "serving.kubernetes.models_dir"]),
    ("pipeline.yaml", _set(["serving", "target"], "kserv"), ["serving.target", "'kserv'", "kubernetes, local"]),
    ("pipeline.yaml", _set(["serving", "target"], "kubernetes"), ["serving.target", "needs serving.kubernetes"]),
    # Bandwidth caps carry their unit, and a cap of 0 would stop every upload.
    ("pipeline.yaml", _set(["bandwidth"], {"endpoints": {"http://10.0.0.5:9000": 200}}),
     ["bandwidth.endpoints.http://10.0.0.5:9000", "has no unit", "'200 MB/s'"]),
    ("pipeline.yaml", _set(["bandwidth"], {"default": "200 MBs"}), ["bandwidth.default", "'200 MBs' is not a byte rate"]),
    ("pipeline.yaml", _set(["bandwidth"], {"default": "0 MB/s"}), ["bandwidth.default", "a cap of 0", "remove the key"]),
    ("clusters.yaml", _set(["clusters", "cloud-east", "upload_cap"], "-5 MB/s"),
     ["clusters.cloud-east.upload_cap", "'-5 MB/s' is not a byte rate"]),
    ("clusters.yaml", _set(["clusters", "cloud-east", "upload_cap"], "100 Mb/s"),
     ["clusters.cloud-east.upload_cap", "Mbit/s"]),
]


@pytest.mark.parametrize(("filename", "mutate", "expected"), BROKEN, ids=[b[2][0] for b in BROKEN])
def test_broken_config_names_file_and_key(tmp_path: Path, filename: str, mutate, expected: list[str]) -> None:
    target = broken_copy(tmp_path, filename, mutate)
    with pytest.raises(ConfigError) as info:
        load_estate(target, use_cache=False)
    message = str(info.value)
    assert str(target / filename) in message
    for part in expected:
        assert part in message, f"{part!r} not in:\n{message}"


def test_kubernetes_backend_with_conn_and_scheduler_loads(tmp_path: Path) -> None:
    def mutate(data: dict) -> None:
        as_kubernetes(data["clusters"]["onprem-a"], conn_id="k8s_onprem_a", scheduler="kueue")

    estate = load_estate(broken_copy(tmp_path, "clusters.yaml", mutate), use_cache=False)
    assert estate.clusters["onprem-a"].scheduler == "kueue"
    assert estate.clusters["onprem-a"].k8s_namespace == "hybridflow"


@pytest.mark.parametrize("ifname", ["eth0", "^lo,docker", "=ib0", "^=docker0,veth", "enp0s31f6"])
def test_nccl_socket_ifname_of_a_kubernetes_cluster_loads(tmp_path: Path, ifname: str) -> None:
    estate = load_estate(broken_copy(tmp_path, "clusters.yaml", _k8s(nccl_socket_ifname=ifname)), use_cache=False)
    assert estate.clusters["onprem-a"].nccl_socket_ifname == ifname


def test_kubernetes_node_labels_are_checked(tmp_path: Path) -> None:
    def mutate(data: dict) -> None:
        as_kubernetes(data["clusters"]["onprem-a"], conn_id="k8s", scheduler="volcano")
        data["clusters"]["onprem-a"]["node_pools"][0]["node_labels"] = {"nvidia.com/gpu.product": "-bad-"}

    with pytest.raises(ConfigError, match=r"node_pools\[0\]\.node_labels\.nvidia\.com/gpu\.product"):
        load_estate(broken_copy(tmp_path, "clusters.yaml", mutate), use_cache=False)


def test_reserved_pool_is_billed_as_reserved(tmp_path: Path) -> None:
    def mutate(data: dict) -> None:
        data["clusters"]["cloud-east"]["node_pools"][0]["pricing"] = "reserved"
        data["clusters"]["cloud-east"]["prices"]["reserved"] = 2.5

    estate = load_estate(broken_copy(tmp_path, "clusters.yaml", mutate), use_cache=False)
    cloud = estate.clusters["cloud-east"]
    assert cloud.pricing_class(cloud.pool("h100-on-demand")) == "reserved"
    assert cloud.price_of(cloud.pool("h100-on-demand")) == pytest.approx(2.5)
    assert estate.queue_of("search") == "search" and estate.teams["perception"].gpu_cap == 8


def test_placement_section_is_optional(tmp_path: Path) -> None:
    estate = load_estate(broken_copy(tmp_path, "pipeline.yaml", _delete(["placement"])), use_cache=False)
    assert estate.pipeline.placement.spill_threshold == pytest.approx(0.7)


def test_several_problems_are_reported_together(tmp_path: Path) -> None:
    def mutate(data: dict) -> None:
        data["clusters"]["onprem-a"]["node_pools"][0]["gpus"] = -1
        data["clusters"]["cloud-east"]["region"] = ""

    with pytest.raises(ConfigError) as info:
        load_estate(broken_copy(tmp_path, "clusters.yaml", mutate), use_cache=False)
    assert "clusters.onprem-a.node_pools[0].gpus" in str(info.value)
    assert "clusters.cloud-east.region" in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("clusters: [unclosed\n", "not valid YAML"),
        ("- just\n- a list\n", "must be a mapping"),
        (
            "clusters:\n  onprem-a: {location: private}\n  onprem-a: {location: public}\n",
            "duplicate key 'onprem-a'",
        ),
    ],
)
def test_unparseable_file_names_the_file(tmp_path: Path, text: str, expected: str) -> None:
    target = tmp_path / "config"
    shutil.copytree(SHIPPED, target)
    (target / "clusters.yaml").write_text(text)
    with pytest.raises(ConfigError, match=expected) as info:
        load_estate(target, use_cache=False)
    assert "clusters.yaml" in str(info.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    target = tmp_path / "config"
    shutil.copytree(SHIPPED, target)
    (target / "projects.yaml").unlink()
    with pytest.raises(ConfigError, match="projects.yaml: file not found"):
        load_estate(target)
