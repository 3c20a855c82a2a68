"""Model bundles: a trained model as a folder that says how to load and serve it.

::

    <bundle>/weights.pt   torch.save(state_dict) of the (possibly converted) module
    <bundle>/model.json   the model card: registered name, builder, hyper-parameters, signature,
                          metric, target column and variant (fp32 | int8 | fp16); written last

Loading calls the registered builder (``build(hparams)``) to make the module, converts it to the
bundle's variant, then loads the weights with ``torch.load(weights_only=True)``, so opening a bundle
never unpickles code. Evaluation, compression, the model server and the Kubernetes serving pods all
load bundles the same way.
"""

from __future__ import annotations

import copy
import io
import json
import os
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow import scoring

BUNDLE_FORMAT = "hybridflow.model-bundle/v1"
CARD_FILE = "model.json"
WEIGHTS_FILE = "weights.pt"
VARIANTS = ("fp32", "int8", "fp16")


@dataclass(frozen=True)
class ModelCard:
    model: str
    build: str
    hyperparameters: dict[str, Any]
    signature: dict[str, Any]
    metric: dict[str, Any]
    target: str
    variant: str = "fp32"
    version: str | None = None  # the run that trained it

    @property
    def input_names(self) -> list[str]:
        from hybridflow.config.registry import Signature

        return Signature.model_validate(self.signature).input_names

    @property
    def output(self) -> dict[str, Any]:
        return self.signature["output"]

    def with_variant(self, variant: str) -> ModelCard:
        return ModelCard(**{**asdict(self), "variant": variant})

    def to_json(self) -> bytes:
        return json.dumps({"format": BUNDLE_FORMAT, **asdict(self)}, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str = "") -> ModelCard:
        try:
            body = json.loads(raw)
            if body.pop("format", None) != BUNDLE_FORMAT:
                raise ValueError(f"not a {BUNDLE_FORMAT} card")
            return cls(**body)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where or 'model card'} is not a model bundle card: {exc}") from exc


@contextmanager
def quiet_torch():
    """torch.ao.quantization warns that it is deprecated, and saving quantized tensors warns about
    TypedStorage; both are noise for callers (the API still works in the pinned torch)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch(\..*)?$")
        yield


def convert(module, variant: str):
    """fp32 module -> the variant's module (a new one; the input is left as it is)."""
    import torch

    if variant == "fp32":
        return module
    if variant == "int8":  # dynamic quantization of the Linear layers: int8 weights, activations per batch
        with quiet_torch():
            return torch.ao.quantization.quantize_dynamic(copy.deepcopy(module), {torch.nn.Linear},
                                                          dtype=torch.qint8).eval()
    if variant == "fp16":
        return copy.deepcopy(module).half().eval()
    raise ValueError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")


def serialise_state(module) -> bytes:
    return serialise_state_dict(module.state_dict())


def serialise_state_dict(state: Mapping[str, Any]) -> bytes:
    """Saved as given: a state dict's ``_metadata`` (module versions) is what lets quantized layers load."""
    import torch

    buf = io.BytesIO()
    with quiet_torch():
        torch.save(state, buf)
    return buf.getvalue()


def write_atomic(path: Path, data: bytes) -> None:
    """Write-then-rename with fsync: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


def write_bundle(folder: Path, weights: bytes, card: ModelCard) -> Path:
    """Weights first, the card last: a folder with a card is a complete bundle."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CARD_FILE).unlink(missing_ok=True)  # a re-write is incomplete until its own card lands
    write_atomic(folder / WEIGHTS_FILE, weights)
    write_atomic(folder / CARD_FILE, card.to_json())
    return folder


def read_card(folder: Path) -> ModelCard:
    path = Path(folder) / CARD_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{folder} is not a model bundle (no {CARD_FILE})") from None
    return ModelCard.from_json(raw, str(path))


def _reason(exc: Exception) -> str:
    """The specific line of torch's multi-paragraph weights-only error, not its boilerplate."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[-1].startswith("Check the documentation"):
        lines.pop()
    return f"{type(exc).__name__}: {lines[-1][:300] if lines else ''}"


def read_weights(path: Path) -> dict[str, Any]:
    """A state dict, without unpickling arbitrary objects; a clear error for anything else."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model weights {path} do not exist")
    try:
        with quiet_torch():
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several unrelated types for a corrupt file
        raise ValueError(f"{path} is not a saved state dict (torch.save(model.state_dict())): {_reason(exc)}") from exc
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def build_module(card: ModelCard):
    """The registered builder's module for ``card``'s hyper-parameters, in eval mode, fp32."""
    from hybridflow.config.registry import resolve

    module = resolve(card.build, argument="hparams")(dict(card.hyperparameters))
    if not hasattr(module, "state_dict") or not hasattr(module, "load_state_dict"):
        raise TypeError(f"{card.build} returned a {type(module).__name__}, not a torch.nn.Module")
    return module.eval()


def load_module(folder: Path):
    """(module of the bundle's variant with its weights loaded, card)."""
    card = read_card(folder)
    state = read_weights(Path(folder) / WEIGHTS_FILE)
    module = convert(build_module(card), card.variant)
    try:
        with quiet_torch():
            module.load_state_dict(state)
    except (RuntimeError, KeyError) as exc:
        raise ValueError(f"{folder}: the weights do not fit {card.build} with its hyper-parameters "
                         f"({card.variant}): {str(exc).splitlines()[0]}") from exc
    return module.eval(), card


class Predictor:
    """A loaded bundle: signature inputs (float32 ``[n, d]``) in, predictions out."""

    def __init__(self, module, card: ModelCard) -> None:
        self.module = module
        self.card = card
        self.input_names = card.input_names
        self.output = card.output

    @classmethod
    def load(cls, folder: Path) -> Predictor:
        return cls(*load_module(folder))

    def raw(self, x: np.ndarray) -> np.ndarray:
        import torch

        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != len(self.input_names):
            raise ValueError(f"expected inputs of shape [n, {len(self.input_names)}], got {list(x.shape)}")
        dtype = torch.float16 if self.card.variant == "fp16" else torch.float32
        with torch.inference_mode():
            out = self.module(torch.from_numpy(np.require(x, np.float32, ["C", "W"])).to(dtype))
        return out.float().numpy()

    def predict(self, x: np.ndarray) -> np.ndarray:
        return scoring.predictions(self.raw(x), self.output)


def inputs_and_target(frame, card: ModelCard) -> tuple[np.ndarray, np.ndarray]:
    """The signature's input columns (float32, in order) and the target column of a split's frame."""
    return frame[card.input_names].to_numpy(dtype=np.float32), frame[card.target].to_numpy()
