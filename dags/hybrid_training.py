"""
### Hybrid training pipeline: one run, one model

Takes a catalogued dataset (`config/datasets.yaml`) to a served, compressed model registered in
`config/models.yaml` (the team's own training code):

`admit` → `validate_data` → `choose_cluster` → `stage_data` → `train` → `evaluate` → `compress` → `deploy` → `record`

* **admit** resolves the model and dataset, takes the data's classification from the catalogue, and checks
  the trigger form, the training code, the suites and the data's header against `config/`.
* **validate_data** runs the dataset's own Great Expectations suites where the data lives and pins the version
  it checked; a failure stops the run.
* **choose_cluster** places the run on one cluster of the estate and logs why every candidate won or lost.
* **stage_data** copies the dataset to a public cluster's cloud cache (incremental, verified, manifest last).
* **train** runs a gang of workers calling the model's `train(ctx)` (all or none; a gang not admitted in time
  fails over to the next candidate cluster); retries resume from the newest committed checkpoint. A preempted
  gang (spot reclaim) is relaunched by the task itself; application errors use the task's retries.
* **evaluate** / **compress** measure the model's registered metric, size and latency; a compressed model that loses
  more than the metric allows is refused.
* **deploy** rolls the model out blue/green behind its endpoint; the old version serves until the new one passes.
* **record** writes the run record that cost allocation reads.

Every task is safe to clear and re-run from the UI.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Param, dag, get_current_context, task

from hybridflow import pipeline
from hybridflow.operators.failfast import fail_fast
from hybridflow.operators.train import GangTrainOperator
from hybridflow.params import TRAINING_PARAMS
from hybridflow.runs import RunIdentity

default_args = {
    "owner": "ml-platform",
    "retries": 2,
    "retry_delay": timedelta(seconds=10),
}


def _identity() -> RunIdentity:
    return RunIdentity.from_context(get_current_context())


@dag(
    dag_id="hybrid_training",
    schedule=None,
    catchup=False,
    max_active_runs=4,
    default_args=default_args,
    tags=["training", "hybrid"],
    doc_md=__doc__,
    params={name: Param(**spec) for name, spec in TRAINING_PARAMS.items()},
    render_template_as_native_obj=True,
)
def hybrid_training():
    @task(retries=0)
    def admit(params=None) -> dict:
        with fail_fast():
            return pipeline.admit(params, _identity())

    @task
    def validate_data(run: dict) -> dict:
        with fail_fast():
            return pipeline.validate_data(run)

    @task
    def choose_cluster(run: dict) -> dict:
        with fail_fast():
            return pipeline.choose_cluster(run)

    @task
    def stage_data(run: dict, placement: dict) -> dict:
        with fail_fast():
            return pipeline.stage_data(run, placement)

    @task
    def evaluate(run: dict, trained: dict) -> dict:
        with fail_fast():
            return pipeline.evaluate(run, trained)

    @task
    def compress(run: dict, trained: dict) -> dict:
        with fail_fast():
            return pipeline.compress(run, trained)

    @task
    def deploy(run: dict, compressed: dict) -> dict:
        return pipeline.deploy(run, compressed)

    @task
    def record(run, validated, placement, staged, trained, evaluated, compressed, deployed) -> dict:
        steps = {
            "validate_data": validated,
            "choose_cluster": placement,
            "stage_data": staged,
            "train": trained,
            "evaluate": evaluated,
            "compress": compressed,
            "deploy": deployed,
        }
        return pipeline.record(run, _identity(), steps)

    run = admit()
    validated = validate_data(run)
    placement = choose_cluster(run)
    validated >> placement
    staged = stage_data(run, placement)
    trained = GangTrainOperator(task_id="train", run=run, placement=placement, staged=staged)
    evaluated = evaluate(run, trained.output)
    compressed = compress(run, trained.output)
    evaluated >> compressed
    deployed = deploy(run, compressed)
    record(run, validated, placement, staged, trained.output, evaluated, compressed, deployed)


hybrid_training()
