"""The contract every deploy target keeps, and the one blue/green sequence that drives it.

A :class:`DeployTarget` serves one endpoint somewhere: ``local`` (a server process per version
behind the model gateway on 127.0.0.1) or ``kubernetes`` (a stable and a canary Deployment behind a
Service on the private inference pool). :func:`roll` takes a new version in through the same steps
on every target:

1. :meth:`~DeployTarget.prepare` checks the request, and puts the bundle where the target reads it,
   before anything starts;
2. :meth:`~DeployTarget.current` says what serves now; if that is the requested version,
   :meth:`~DeployTarget.keep` returns its result untouched (a re-run changes nothing);
3. :meth:`~DeployTarget.stage` starts the new (green) version next to the serving (blue) one, taking
   no traffic or a canary's share;
4. :meth:`~DeployTarget.check` must pass before traffic moves (readiness, health, smoke and load);
5. :meth:`~DeployTarget.shift` moves traffic to green, once per step of :meth:`~DeployTarget.steps`
   (``serving.canary.steps``, e.g. 10, 50, 100; 100: green takes everything), each step with its
   own check; the check of the last step is the check after promotion, blue still running;
6. :meth:`~DeployTarget.retire` stops blue once green serves everything and passed that check.

A failure in 4 or 5 calls :meth:`~DeployTarget.rollback`, which puts blue back in front and stops
green; blue keeps serving throughout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

if TYPE_CHECKING:
    import numpy as np

    from hybridflow.config import Estate


@dataclass(frozen=True)
class DeployRequest:
    """One model version to serve. ``smoke`` is read only by targets that smoke-test through the
    server: held-out (inputs ``[n, d]`` in the signature's order, targets ``[n]``)."""

    version: str
    bundle_dir: Path | None = None  # None: already where the target reads it
    variant: str | None = None  # fp32 | int8 | fp16, for targets that publish the bundle
    metric: Mapping[str, Any] | None = None  # the model's metric spec (name, gate, ...)
    smoke: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None


@dataclass(frozen=True)
class Serving:
    """The version an endpoint serves now (None if the target cannot tell) and what is recorded of it."""

    version: str | None
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Staged:
    """The green side once started; each target keeps its own handles in a subclass."""

    version: str
    previous: Serving | None


S = TypeVar("S", bound=Staged)


class DeployTarget(ABC, Generic[S]):
    """Blue/green for one endpoint on one kind of target; :func:`roll` calls the steps in order.
    ``S`` is the target's own :class:`Staged`."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_estate(cls, estate: Estate, endpoint: str, *, state_dir: Path, log: Any = None) -> DeployTarget[S]:
        """The target for ``endpoint`` as the estate's ``serving`` settings describe it."""

    @abstractmethod
    def prepare(self, request: DeployRequest) -> Any:
        """Check ``request`` (ValueError or DeploymentError before anything starts) and return the
        plan the later steps work from."""

    def exclusive(self) -> AbstractContextManager[Any]:
        """Held from :meth:`current` to the end: one deployer of the endpoint at a time."""
        return nullcontext()

    @abstractmethod
    def current(self) -> Serving | None:
        """What serves the endpoint now; None if nothing does."""

    @abstractmethod
    def keep(self, current: Serving, plan: Any) -> dict[str, Any] | None:
        """``current`` already runs the requested version: its result, changing nothing; None if it must
        be deployed again (e.g. its server is gone)."""

    @abstractmethod
    def stage(self, plan: Any, current: Serving | None) -> S:
        """Start the new version next to ``current``."""

    @abstractmethod
    def check(self, staged: S) -> None:
        """Raise unless the new version is fit to take traffic."""

    def steps(self, staged: S) -> Sequence[int]:
        """The traffic shares (percent) the new version takes in turn; the last one is 100."""
        return (100,)

    @abstractmethod
    def shift(self, staged: S, percent: int) -> None:
        """Send ``percent`` of the endpoint's traffic to the new version and check it there."""

    @abstractmethod
    def rollback(self, staged: S, error: BaseException) -> Exception | None:
        """Put the previous version back in front and stop the new one after ``error``; return the
        error to raise in its place, or None to raise ``error`` itself."""

    @abstractmethod
    def retire(self, staged: S) -> None:
        """The new version serves everything: stop the previous one."""

    @abstractmethod
    def result(self, staged: S) -> dict[str, Any]:
        """What the deployment did, for the task's return value and the run record."""

    def live_versions(self) -> dict[str, str | None]:
        """version -> variant (None where the target does not say) of every version serving the
        endpoint now: the stable one and a canary beside it."""
        current = self.current()
        return {current.version: current.detail.get("variant")} if current is not None and current.version else {}

    # -- the disaster-recovery side (hybridflow.serving.takeover): a target of the DR cluster's pool --
    def take_over(self, version: str, bundle: Path) -> tuple[str, Any, bool]:
        """Serve ``version`` of ``bundle`` (a verified replica) with all of the endpoint's traffic, now,
        checked as far as can be without held-out data: (its URL, the answer to one prediction made
        from the model's signature or None where the server cannot be reached from here, whether
        anything was started)."""
        from hybridflow.errors import DeploymentError

        raise DeploymentError(f"the {self.name} deploy target does not serve from a DR cluster's inference pool")

    def remove(self) -> bool:
        """Stop everything serving the endpoint here (the DR pool after a failback); whether anything was."""
        from hybridflow.errors import DeploymentError

        raise DeploymentError(f"the {self.name} deploy target does not serve from a DR cluster's inference pool")


def roll(target: DeployTarget[Any], request: DeployRequest) -> dict[str, Any]:
    """Serve ``request`` on ``target``, blue/green; see the module's docstring for the steps."""
    plan = target.prepare(request)
    with target.exclusive():
        current = target.current()
        if current is not None and current.version == request.version:
            kept = target.keep(current, plan)
            if kept is not None:
                return kept
        staged = target.stage(plan, current)
        try:
            target.check(staged)
            for percent in target.steps(staged):
                target.shift(staged, percent)
        except BaseException as exc:
            replacement = target.rollback(staged, exc)
            if replacement is None:
                raise
            raise replacement from exc
        target.retire(staged)
        return target.result(staged)
