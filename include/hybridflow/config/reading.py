"""Reading one estate YAML file into its model: duplicate keys refused, and every error named by file,
key path and what to change."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from hybridflow.errors import ConfigError

_M = TypeVar("_M", bound=BaseModel)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: plain YAML silently keeps the last one."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}; keep only one", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: Path, allow_empty: bool) -> dict:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}; fix the syntax at the line shown") from exc
    if data is None and allow_empty:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def _validate(model: type[_M], path: Path, allow_empty: bool = False) -> _M:
    data = _read_yaml(path, allow_empty)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(path, model, err) for err in exc.errors()]
        raise ConfigError(f"invalid {path.name}:\n" + "\n".join(f"  - {line}" for line in lines)) from None


def key_path(loc: tuple[Any, ...]) -> str:
    """``('clusters', 'a', 'node_pools', 0, 'gpus')`` -> ``clusters.a.node_pools[0].gpus``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]":
            out += " (the key itself)"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _describe(path: Path, model: type[BaseModel], err: dict[str, Any]) -> str:
    loc = tuple(err["loc"])
    where = f"{path}: {key_path(loc)}"
    kind = err["type"]
    if kind == "missing":
        return f"{where}: required key is missing; add `{loc[-1]}: <value>`"
    if kind == "extra_forbidden":
        allowed = _allowed_keys(model, loc[:-1])
        hint = f"; allowed keys here: {', '.join(allowed)}" if allowed else ""
        return f"{where}: unknown key; remove it or fix its spelling{hint}"
    value = err.get("input")
    shown = "" if isinstance(value, dict | list) else f" (got {value!r})"
    fix = "rename the key" if loc and loc[-1] == "[key]" else f"change the value in {path.name}"
    # A validator's own message already says what to do; pydantic's "Value error, " adds nothing.
    return f"{where}: {err['msg'].removeprefix('Value error, ')}{shown}; {fix}"


def _allowed_keys(model: Any, loc: tuple[Any, ...]) -> list[str]:
    """Walk the model's annotations along ``loc`` to list the keys the YAML may use there."""
    current: Any = model
    for part in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part) if isinstance(part, str) else None
            if field is None:
                return []
            current = field.annotation
        elif get_origin(current) in (dict, list):
            current = get_args(current)[-1]
        else:
            return []
    current = _unwrap(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _unwrap(tp: Any) -> Any:
    # Optional[X] / X | None / Annotated[X, ...] -> X, so the walk can continue into X.
    origin = get_origin(tp)
    if origin is Annotated:
        return _unwrap(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else tp
    return tp
