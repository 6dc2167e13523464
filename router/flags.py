"""Command-line flags generated from the ``Settings`` model, so every knob has a flag.

``health.interval_s`` becomes ``--health-interval-s``; lists of workers, client keys and
tokenizers are repeatable (``--worker``, ``--api-key``, ``--tokenizer``); booleans take
``--x`` / ``--no-x``; other structured values take JSON. Only flags actually given are
returned, so lower-precedence sources (env, YAML) keep theirs.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, Union, get_args, get_origin

import msgspec
from pydantic import BaseModel
from pydantic.fields import FieldInfo

# fields whose flag is repeatable and singular: field -> (flag, metavar, help)
_REPEATABLE: Mapping[str, tuple[str, str, str]] = MappingProxyType(
    {
        "workers": (
            "--worker",
            "SPEC",
            "an engine replica: URL[,engine=vllm|sglang|openai][,models=a;b][,events=tcp://H:P]"
            "[,replay=tcp://H:P][,api_key=KEY] (repeatable)",
        ),
        "api_keys": ("--api-key", "KEY", "a client API key accepted as Bearer (repeatable)"),
        "worker_allow": (
            "--worker-allow",
            "RULE",
            "a host workers added at run time may be on: a CIDR (10.0.0.0/8) or a host pattern "
            "(*.svc.cluster.local); '*' allows any; none given: loopback and the hosts of "
            "configured and discovered workers (repeatable)",
        ),
        "pass_through_paths": (
            "--pass-through-path",
            "PATH",
            "an engine path passed through besides embeddings, rerank, score and responses "
            "by id, e.g. /v1/load_lora_adapter (any client key may then use it; repeatable)",
        ),
        "discover": (
            "--discover",
            "URL",
            "engines behind a DNS name, re-resolved periodically: dns://HOST:PORT[?events_port=5557"
            "&replay_port=5558&engine=vllm&interval=5&family=ipv4&remove_after=2] (repeatable)",
        ),
        "tokenizers": (
            "--tokenizer",
            "[MODEL=]DIR",
            "tokenizer directory (tokenizer.json + tokenizer_config.json) for MODEL, or for every "
            "model without MODEL= (repeatable)",
        ),
    }
)


@dataclass(frozen=True)
class _Flag:
    dest: str  # dotted path in the settings, e.g. "health.interval_s"
    info: FieldInfo
    env: str


_ALIASES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"scoring.cost_model": ("--scoring-cost",)}
)
"""Short spellings of a flag, beside the one derived from its field's path."""


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return bool in get_args(annotation) and all(
            a in (bool, type(None)) for a in get_args(annotation)
        )
    return False


def _is_structured(annotation: Any) -> bool:
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return any(_is_structured(a) for a in get_args(annotation))
    return origin in (list, dict, tuple, set) or _is_model(annotation)


def _fields(model: type[BaseModel], prefix: str = "") -> Iterator[_Flag]:
    for name, info in model.model_fields.items():
        dest = f"{prefix}{name}"
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _fields(annotation, f"{dest}.")
        else:
            yield _Flag(dest, info, "KVGATE_" + dest.upper().replace(".", "__"))


def _help(flag: _Flag, text: str | None = None) -> str:
    text = text or flag.info.description or ""
    default = flag.info.get_default(call_default_factory=True)
    shown = "" if default in (None, [], {}) else f"default: {default}; "
    return f"{text} ({shown}env {flag.env})".replace("%", "%%")


def add_settings_flags(parser: argparse.ArgumentParser, settings_model: type[BaseModel]) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in _fields(settings_model):
        section = flag.dest.split(".")[0] if "." in flag.dest else "general"
        group = groups.get(section) or groups.setdefault(
            section, parser.add_argument_group(f"{section} settings")
        )
        name = flag.dest.split(".")[-1] if "." not in flag.dest else flag.dest
        option = "--" + name.replace(".", "-").replace("_", "-")
        if flag.dest in _REPEATABLE:
            option, metavar, text = _REPEATABLE[flag.dest]
            group.add_argument(
                option, dest=flag.dest, metavar=metavar, action="append", help=_help(flag, text)
            )
        elif _is_bool(flag.info.annotation):
            group.add_argument(
                option, dest=flag.dest, action=argparse.BooleanOptionalAction, help=_help(flag)
            )
        elif _is_structured(flag.info.annotation):
            group.add_argument(
                option, dest=flag.dest, metavar="JSON", type=_json_value, help=_help(flag)
            )
        else:
            aliases = _ALIASES.get(flag.dest, ())
            group.add_argument(
                option, *aliases, dest=flag.dest, help=_help(flag), **_shape(flag.info)
            )


def _shape(info: FieldInfo) -> dict[str, Any]:
    """Metavar (and choices) of a scalar flag from its annotation."""
    annotation = info.annotation
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if get_origin(annotation) is Literal:
        return {"choices": list(get_args(annotation))}
    if annotation is int:
        return {"metavar": "N"}
    if annotation is float:
        return {"metavar": "X"}
    return {"metavar": "TEXT"}


def _json_value(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected JSON, got {text!r}") from exc


def given_settings(
    namespace: argparse.Namespace, settings_model: type[BaseModel]
) -> dict[str, Any]:
    """The flags present on the command line, as a nested dict of settings overrides."""
    values = vars(namespace)
    overrides: dict[str, Any] = {}
    for flag in _fields(settings_model):
        value = values.get(flag.dest)
        if value is None:
            continue
        *parents, leaf = flag.dest.split(".")
        node = overrides
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return overrides
