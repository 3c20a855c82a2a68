"""Model serving: where a deploy puts a new model version, and the servers that answer for it.

:data:`DEPLOY_TARGETS` names every deploy target by dotted path, imported only when chosen;
:func:`deploy_target` is the one place that picks the implementation for the estate's ``serving``
settings. Everything else talks to the :class:`~hybridflow.serving.base.DeployTarget` it returns,
driven by :func:`~hybridflow.serving.base.roll`. Nothing heavy is imported here: the model server
(``python -m hybridflow.serving.server``) runs in pods that import this package.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.config import Estate, ServingSettings
    from hybridflow.serving.base import DeployTarget

# name -> "module.Class"; the name is what ``serving.target`` in pipeline.yaml holds, one of
# config's DEPLOY_TARGET_NAMES (config checks the name; this table imports the class).
DEPLOY_TARGETS: dict[str, str] = {
    "local": "hybridflow.serving.deploy.LocalTarget",
    "kubernetes": "hybridflow.serving.k8s.KubernetesTarget",
    "kserve": "hybridflow.serving.kserve.KServeTarget",
}
TARGET_FIELD = "serving.target"


def target_name(serving: ServingSettings) -> str:
    """The configured deploy target: ``serving.target`` when set; else, when ``serving.kubernetes``
    describes the private inference pool, ``kserve`` for ``kind: kserve`` (an InferenceService) and
    ``kubernetes`` for ``kind: deployment``; and ``local`` (the model gateway on 127.0.0.1) otherwise."""
    if serving.target is not None:
        return serving.target
    if serving.kubernetes is None:
        return "local"
    return "kserve" if serving.kubernetes.kind == "kserve" else "kubernetes"


def target_class(name: str) -> type[DeployTarget[Any]]:
    """The implementation named ``name``; ConfigError naming the field and the valid names otherwise."""
    from hybridflow.errors import ConfigError

    path = DEPLOY_TARGETS.get(name) if isinstance(name, str) else None
    if path is None:
        raise ConfigError(f"{TARGET_FIELD}: {name!r} is not a deploy target; use one of: "
                          f"{', '.join(sorted(DEPLOY_TARGETS))}")
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def deploy_target(estate: Estate, endpoint: str, *, state_dir: Path, log: Any = None,
                  name: str | None = None) -> DeployTarget[Any]:
    """The deploy target of ``endpoint``: ``name``, or the one the estate's serving settings choose
    (``state_dir``: where a local target keeps its processes' records)."""
    chosen = target_name(estate.pipeline.serving) if name is None else name
    return target_class(chosen).from_estate(estate, endpoint, state_dir=state_dir, log=log)
