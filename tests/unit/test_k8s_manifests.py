"""Gang manifests: every generated object validates against the real CRD schema (Volcano Job) or
Kubernetes' own schemas (batch/v1 Job, Service, Secret, PriorityClass), names are deterministic
DNS-1123 labels, and bad specs are refused naming the field."""

from __future__ import annotations

import dataclasses

import jsonschema
import kubernetes_validate
import pytest
import yaml
from tests.support.k8s_sim import REFERENCE, crd_schema

from hybridflow.backends.k8s.manifests import (
    GANG_LABEL,
    KUEUE_QUEUE_LABEL,
    GangSpec,
    ManifestError,
    env_secret,
    gang_job_name,
    gang_manifest,
    kueue_job,
    priority_classes,
    rendezvous_service,
    volcano_job,
)
from hybridflow.config import NodePool

K8S = "1.33"
POOL = NodePool(name="h100", gpu_model="H100-80GB", gpu_memory_gib=80, gpus=16,
                node_labels={"hybridflow.io/pool": "h100", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"})


def _spec(**kw) -> GangSpec:
    base = dict(name=gang_job_name("train_model", "manual__2026-12-03", "train", "cloud-east", readable="train-r1"),
                namespace="hybridflow", workers=4, image="ghcr.io/example/trainer:1.0",
                command=("python", "-m", "hybridflow.training.worker"), pool=POOL, queue="vision",
                priority="batch", labels={"project": "digits", "team": "vision"},
                env={"HYBRIDFLOW_JOB_SPEC": '{"run_key": "r1"}'}, env_secret="train-r1-env")
    return GangSpec(**{**base, **kw})


def test_volcano_job_validates_against_the_crd_and_gangs_all_workers():
    job = volcano_job(_spec())
    jsonschema.validate(job, crd_schema("volcano/batch.volcano.sh_jobs.yaml"))
    spec = job["spec"]
    assert spec["minAvailable"] == 4 and spec["queue"] == "vision" and spec["schedulerName"] == "volcano"
    assert spec["priorityClassName"] == "hybridflow-batch"
    # Volcano takes the first match: exit 75 (preempted) and eviction restart the job under maxRetry,
    # any other failure terminates it (the task's retries apply).
    assert spec["policies"] == [{"exitCode": 75, "action": "RestartJob"},
                                {"event": "PodEvicted", "action": "RestartJob"},
                                {"event": "PodFailed", "action": "TerminateJob"}]
    # Volcano's maxRetry N allows N - 1 restarts: max_retry 3 restarts need 4
    assert spec["maxRetry"] == 4 and set(spec["plugins"]) == {"pytorch", "svc", "env"}
    assert [(t["name"], t["replicas"]) for t in spec["tasks"]] == [("master", 1), ("worker", 3)]
    pod = spec["tasks"][1]["template"]["spec"]
    assert pod["nodeSelector"] == POOL.node_labels
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": "train-r1-env"}}]
    assert pod["terminationGracePeriodSeconds"] == 40  # the 30 s checkpoint grace, plus time to close
    assert volcano_job(_spec(grace_s=120.5))["spec"]["tasks"][0]["template"]["spec"]["terminationGracePeriodSeconds"] == 131
    assert spec["tasks"][0]["template"]["metadata"]["labels"][GANG_LABEL] == job["metadata"]["name"]
    # The pod template is a valid core PodTemplateSpec too.
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                  "template": spec["tasks"][1]["template"]}, K8S, strict=True)


def test_single_worker_volcano_job_has_only_a_master():
    job = volcano_job(_spec(workers=1))
    jsonschema.validate(job, crd_schema("volcano/batch.volcano.sh_jobs.yaml"))
    assert [t["name"] for t in job["spec"]["tasks"]] == ["master"] and job["spec"]["minAvailable"] == 1


def test_schema_check_is_real():
    """The CRD schema rejects what the API server would: the checks above can fail."""
    job = volcano_job(_spec())
    job["spec"]["minAvailable"] = "4"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(job, crd_schema("volcano/batch.volcano.sh_jobs.yaml"))
    bad = kueue_job(_spec())
    bad["spec"]["parallelism"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S, strict=True)


def test_reference_volcano_examples_pass_the_same_check():
    for path in (REFERENCE / "volcano/examples").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Job":
                jsonschema.validate(doc, crd_schema("volcano/batch.volcano.sh_jobs.yaml"))


def test_kueue_job_is_a_valid_suspended_indexed_batch_job():
    job = kueue_job(_spec(priority="critical"))
    kubernetes_validate.validate(job, K8S, strict=True)
    spec = job["spec"]
    assert job["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "vision"
    assert spec["suspend"] is True and spec["parallelism"] == spec["completions"] == 4
    assert spec["completionMode"] == "Indexed"
    pod = spec["template"]["spec"]
    assert pod["priorityClassName"] == "hybridflow-critical" and pod["subdomain"] == job["metadata"]["name"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["WORLD_SIZE"]["value"] == "4" and env["MASTER_ADDR"]["value"].startswith(job["metadata"]["name"] + "-0.")
    assert "valueFrom" in env["RANK"]
    # Preemption is not counted towards backoffLimit; any other failure fails the Job at once.
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [75]}},
        {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "NotIn", "values": [75]}},
    ]
    assert pod["restartPolicy"] == "Never"  # what a podFailurePolicy requires


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_scratch_volume_is_mounted_in_every_worker(scheduler):
    job = gang_manifest(_spec(volumes=(("scratch-fs", "/scratch"),)), scheduler)
    if scheduler == "volcano":
        jsonschema.validate(job, crd_schema("volcano/batch.volcano.sh_jobs.yaml"))
        templates = [t["template"] for t in job["spec"]["tasks"]]
    else:
        kubernetes_validate.validate(job, K8S, strict=True)
        templates = [job["spec"]["template"]]
    for template in templates:
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, K8S, strict=True)
        pod = template["spec"]
        assert pod["volumes"] == [{"name": "vol-0", "persistentVolumeClaim": {"claimName": "scratch-fs"}}]
        assert pod["containers"][0]["volumeMounts"] == [{"name": "vol-0", "mountPath": "/scratch"}]


def test_companion_objects_validate():
    spec = _spec()
    for obj in [rendezvous_service(spec), env_secret("train-r1-env", "hybridflow", {"AWS_SECRET_ACCESS_KEY": "x"},
                                                   spec.name), *priority_classes()]:
        kubernetes_validate.validate(obj, K8S, strict=True)


def test_names_are_deterministic_dns_labels_that_differ_per_run_and_cluster():
    a = gang_job_name("train_model", "manual__1", "train", "cloud-east", readable="train-R_1")
    assert a == gang_job_name("train_model", "manual__1", "train", "cloud-east", readable="train-R_1")
    assert a.startswith("train-r-1-")
    others = {gang_job_name("train_model", "manual__2", "train", "cloud-east"),
              gang_job_name("train_model", "manual__1", "train", "onprem-b"),
              gang_job_name("train_model", "manual__1", "train2", "cloud-east")}
    assert a not in others and len(others) == 3
    long = gang_job_name("d" * 200, "r" * 200, "t", "c", readable="9" + "x" * 100)
    assert len(long) <= 45 and long[0].isalpha()
    for name in (a, long, *others):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}}, K8S)


@pytest.mark.parametrize(("field", "value"), [
    ("workers", 0), ("workers", -2), ("workers", 10**6), ("workers", 17), ("workers", True),
    ("gpus_per_worker", 0), ("priority", "urgent"), ("image", ""), ("command", ()),
    ("queue", "Team A"), ("max_retry", -1), ("name", "Train_Model"), ("namespace", "kube system"),
    ("labels", {"team": "a b"}), ("env", {"1BAD": "x"}), ("env_secret", "Bad_Secret"),
    ("volumes", (("Scratch_FS", "/scratch"),)), ("volumes", (("scratch", "scratch"),)), ("grace_s", 0),
])
def test_bad_specs_are_refused_naming_the_field(field, value):
    with pytest.raises(ManifestError) as info:
        volcano_job(dataclasses.replace(_spec(), **{field: value}))
    assert info.value.field.split(".")[0] == field


def test_unknown_scheduler_is_refused():
    with pytest.raises(ManifestError, match="scheduler.*volcano or kueue"):
        gang_manifest(_spec(), "slurm")


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_the_job_its_pods_and_its_secret_name_their_owner_for_the_reaper(scheduler):
    from hybridflow.backends.base import owner_annotations
    from hybridflow.reaper.owners import owner_from_annotations

    owner = {"dag_id": "hybrid_training", "run_id": "manual__2026-12-05T09:00:00+00:00", "task_id": "train",
             "try_number": 2}
    spec = _spec(annotations=owner_annotations(owner))
    job = gang_manifest(spec, scheduler)
    if scheduler == "volcano":
        jsonschema.validate(job, crd_schema("volcano/batch.volcano.sh_jobs.yaml"))
        templates = [t["template"] for t in job["spec"]["tasks"]]
    else:
        kubernetes_validate.validate(job, K8S, strict=True)
        templates = [job["spec"]["template"]]
    secret = env_secret("train-r1-env", "hybridflow", {"AWS_SECRET_ACCESS_KEY": "x"}, spec.name, spec.annotations)
    kubernetes_validate.validate(secret, K8S, strict=True)
    for metadata in [job["metadata"], secret["metadata"], *(t["metadata"] for t in templates)]:
        found = owner_from_annotations(metadata["annotations"])
        assert (found.dag_id, found.run_id, found.task_id, found.try_number) == (
            "hybrid_training", "manual__2026-12-05T09:00:00+00:00", "train", 2)
    assert "annotations" not in gang_manifest(_spec(), scheduler)["metadata"]  # no owner, no annotations


def _env(job: dict) -> dict:
    tasks = job["spec"].get("tasks") or [{"template": job["spec"]["template"]}]
    envs = [{e["name"]: e.get("value", e.get("valueFrom")) for e in t["template"]["spec"]["containers"][0]["env"]}
            for t in tasks]
    assert all(e == envs[0] for e in envs)  # master and workers alike
    return envs[0]


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_every_pod_is_told_to_use_its_gpus_one_rank_per_pod(scheduler):
    env = _env(gang_manifest(_spec(), scheduler))
    assert (env["HYBRIDFLOW_DEVICE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("cuda", "0", "1")
    assert "NCCL_SOCKET_IFNAME" not in env  # unset in clusters.yaml: NCCL chooses


def test_kueue_pods_get_their_node_rank_from_the_completion_index():
    job = kueue_job(_spec())
    kubernetes_validate.validate(job, K8S, strict=True)
    env = _env(job)
    index = {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert env["RANK"] == env["GROUP_RANK"] == env["NODE_RANK"] == index
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (f"{job['metadata']['name']}-0.{job['metadata']['name']}",
                                                       "23456")


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_the_clusters_nccl_interface_reaches_every_pod(scheduler):
    job = gang_manifest(_spec(nccl_socket_ifname="^lo,docker"), scheduler)
    if scheduler == "kueue":
        kubernetes_validate.validate(job, K8S, strict=True)
    assert _env(job)["NCCL_SOCKET_IFNAME"] == "^lo,docker"
