"""The training pipeline's trigger form: one entry per Param, with its title and description.

Kept free of Airflow and heavy imports so DAG files parse fast; ``admission`` re-checks every value
against the estate in config/ (the form only checks types and ranges).
"""

from __future__ import annotations

from typing import Any

TRAINING_PARAMS: dict[str, dict[str, Any]] = {
    "model": {
        "default": None,
        # null too: the Airflow 3 trigger form sends null for a cleared field.
        "type": ["null", "string"],
        "title": "Model",
        "description": "A model registered in config/models.yaml (its training code, metric and serving "
        "signature). Empty: pipeline.yaml's defaults.model.",
    },
    "dataset": {
        "default": None,
        "type": ["null", "string"],
        "title": "Dataset",
        "description": "A dataset of the catalogue, config/datasets.yaml, with the columns the model reads. "
        "Empty: the model's own dataset.",
    },
    "project": {
        "default": None,
        "type": ["null", "string"],
        "title": "Project",
        "description": "The project the run belongs to (config/projects.yaml); quotas and cost follow it. "
        "Empty: the model's project.",
    },
    "classification": {
        "default": None,
        "type": ["null", "string"],
        "enum": [None, "public", "internal", "restricted"],
        # The form shows a select; null would read "null" without a label of its own.
        "values_display": {"null": "(the catalogue's)", "public": "public", "internal": "internal",
                           "restricted": "restricted"},
        "title": "Raise the data classification",
        "description": "The dataset's classification comes from the catalogue; set this only to handle the data "
        "more strictly for this run (e.g. restricted: private clusters and storage only). It cannot be lowered.",
    },
    "regions": {
        "default": None,
        "type": ["null", "array"],
        "items": {"type": "string"},
        "title": "Keep the data in these regions",
        "description": "Cluster regions or jurisdictions (clusters.yaml) this run may use, one per line, within "
        "what the dataset allows (e.g. eu). Empty: wherever the dataset may go.",
    },
    "hyperparameters": {
        "default": None,
        "type": ["null", "object"],
        "title": "Hyper-parameters",
        "description": "Overrides of the model's hyper-parameters (models.yaml), e.g. {\"steps\": 200}; "
        "each is checked against its type and range.",
    },
    "workers": {
        "default": 2,
        "type": "integer",
        "minimum": 1,
        "maximum": 64,
        "title": "Workers (GPUs)",
        "description": "Gang size: all workers start together or none do. Capped by the project's quota.",
    },
    "gpu_type": {
        "default": "A100-80GB",
        "type": "string",
        "title": "GPU type",
        "description": "GPU model each worker needs, as named in config/projects.yaml gpu_types.",
    },
    "priority": {
        "default": "normal",
        "type": "string",
        "enum": ["critical", "normal", "batch"],
        "title": "Priority",
        "description": "critical may preempt batch work; batch waits when the team's cap is reached.",
    },
    "interruptible": {
        "default": False,
        "type": "boolean",
        "title": "Interruptible",
        "description": "The run tolerates preemption (it resumes from its newest checkpoint).",
    },
    "spot_allowed": {
        "default": False,
        "type": "boolean",
        "title": "Spot allowed",
        "description": "May run on spot capacity (cheaper, reclaimable). Requires interruptible.",
    },
    "cluster_preference": {
        "default": "auto",
        "type": "string",
        "enum": ["auto", "private", "public"],
        "title": "Cluster preference",
        "description": "auto: private first, spill to public when the private queue is busy.",
    },
    "placement_strategy": {
        "default": "local_first",
        "type": "string",
        "enum": ["local_first", "elastic_first"],
        "title": "Placement strategy",
        "description": "With cluster_preference auto: local_first fills private clusters up to the spill "
        "threshold, elastic_first takes public capacity first. Restricted data stays private either way.",
    },
    "start_by": {
        "default": None,
        "type": ["null", "string"],
        "title": "Start within",
        "description": "A deadline for the gang to start, as a duration (e.g. 30m, 2h, 1h30m, 1d or PT2H). "
        "Placement then picks the cheapest eligible cluster expected to start in time, from the ledger's history "
        "of queue waits. Empty: the usual rules.",
    },
    "max_price_per_gpu_hour": {
        "default": 0.0,
        "type": "number",
        "minimum": 0,
        "maximum": 1000,
        "title": "Price ceiling (USD per GPU-hour)",
        "description": "Only pools at or below this price; 0 means no ceiling.",
    },
    "model_params_b": {
        "default": 0.0,
        "type": "number",
        "minimum": 0,
        "maximum": 10000,
        "title": "Model size (billions of parameters)",
        "description": "For the GPU memory check at admission; 0 means the model's registered parameter count.",
    },
    "precision": {
        "default": "fp32",
        "type": "string",
        "enum": ["fp32", "bf16", "fp16"],
        "title": "Training precision",
        "description": "Bytes per weight and gradient: 4 (fp32) or 2 (bf16/fp16, plus an fp32 master copy).",
    },
    "optimizer": {
        "default": "sgd_momentum",
        "type": "string",
        "enum": ["sgd", "sgd_momentum", "adamw"],
        "title": "Optimizer",
        "description": "Its state per parameter: sgd 0, sgd_momentum 4, adamw 8 bytes (fp32).",
    },
    "sharding": {
        "default": "none",
        "type": "string",
        "enum": ["none", "zero1", "zero2", "zero3"],
        "title": "State sharding",
        "description": "ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 (FSDP) also weights.",
    },
    "checkpoint_every_steps": {
        "default": 50,
        "type": "integer",
        "minimum": 1,
        "title": "Checkpoint every N steps",
        "description": "A retried or preempted run loses at most this many steps (the training code asks "
        "ctx.checkpoint.due(step)).",
    },
    "compression": {
        "default": "best",
        "type": "string",
        "enum": ["int8", "fp16", "best"],
        "title": "Compression",
        "description": "int8 dynamic quantization, fp16 half precision, or best: the smallest that keeps accuracy.",
    },
    "deploy": {
        "default": True,
        "type": "boolean",
        "title": "Deploy",
        "description": "Roll the compressed model out to the private inference endpoint (blue/green).",
    },
    "budget_override": {
        "default": "",
        # null too: the Airflow 3 trigger form treats "" in a non-nullable field as missing and
        # will not submit, and it sends null once the field is cleared.
        "type": ["null", "string"],
        "maxLength": 500,
        "title": "Budget override",
        "description": "Only for critical runs of a project frozen by its budget: why it must run anyway "
        "(kept in the run record). Leave empty otherwise.",
    },
}

PARAM_DEFAULTS: dict[str, Any] = {name: spec["default"] for name, spec in TRAINING_PARAMS.items()}
