"""Command-line flags generated from the ``Settings`` model, grouped for the reader.

``health.interval_s`` becomes ``--health-interval-s``; lists of workers, client keys and
tokenizers are repeatable (``--worker``, ``--api-key``, ``--tokenizer``); booleans take
``--x`` / ``--no-x``; other structured values take JSON. Only flags actually given are
returned, so lower-precedence sources (env, YAML) keep theirs.

``kvgate serve --help`` shows the options most users need first (``GROUPS``). Settings
without a user's everyday reason to change them (bounds on what engines send, connection
pools, the index's internals: ``FILE_ONLY``) are read from the config file and ``KVGATE_*``
variables only; ``--help-all`` lists them. A setting in neither is shown last, under
"other settings", rather than hidden.
"""

from __future__ import annotations

import argparse
import enum
import fnmatch
import types
from argparse import SUPPRESS
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, NoReturn, Union, get_args, get_origin

import msgspec
from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo

# fields whose flag is repeatable and singular: field -> (flag, metavar, help)
_REPEATABLE: Mapping[str, tuple[str, str, str]] = MappingProxyType(
    {
        "workers": (
            "--worker",
            "SPEC",
            "an engine replica to route to: URL[,engine=vllm|sglang|trtllm|openai][,models=a;b]"
            "[,events=tcp://H:P][,replay=tcp://H:P][,dp_size=N][,api_key=KEY]; its KV events "
            "(events=) make routing cache-aware; dp_size: its data-parallel ranks, each "
            "publishing on the events port + rank (repeatable)",
        ),
        "api_keys": (
            "--api-key",
            "KEY",
            "a client API key accepted as Bearer; set one to refuse requests without it, one "
            "per tenant to keep tenants apart (repeatable)",
        ),
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
            "engines behind a DNS name (a Kubernetes headless service), re-resolved as replicas "
            "come and go: dns://HOST:PORT[?events_port=5557&replay_port=5558&engine=vllm"
            "&interval=5&family=ipv4&remove_after=2] (repeatable)",
        ),
        "tokenizers": (
            "--tokenizer",
            "[MODEL=]DIR",
            "the model's tokenizer directory (tokenizer.json + tokenizer_config.json), so that "
            "kvgate keys prompts as the engine does; MODEL=DIR for one of several models "
            "(repeatable)",
        ),
    }
)

GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "start here: the engines, their tokenizer, where kvgate listens",
        ("workers", "discover", "tokenizers", "sim", "sim_port", "sim_events_port", "host", "port"),
    ),
    (
        "access: client keys, the admin API, what engines are sent",
        (
            "api_keys",
            "admin_token",
            "worker_allow",
            "pass_through_paths",
            "max_body_bytes",
            "index.engine_tokenize",
        ),
    ),
    (
        "routing: where a request goes (docs/scoring.md)",
        ("policy", "scoring.*", "seed", "kv_index", "index.block_size", "index.max_entries"),
    ),
    ("capacity and queue: when a request waits (docs/scoring.md)", ("scheduling.*", "queue.*")),
    (
        "engines: health, timeouts, retries",
        (
            "health.interval_s",
            "health.metrics_interval_s",
            "upstream.read_timeout_s",
            "upstream.response_timeout_s",
            "upstream.max_failover",
            "client.max_connections",
            "capture_usage",
            "shutdown_timeout_s",
        ),
    ),
    (
        "observability (docs/observability.md)",
        (
            "log_level",
            "log_format",
            "access_log",
            "access_log_sample_rate",
            "otlp_traces_endpoint",
            "trace_sample_rate",
            "trace_trust_parent",
            "metrics_auth",
        ),
    ),
)
"""The groups of ``kvgate serve --help``, in order, each with its settings (patterns on the
dotted setting path), in order."""
FILE_ONLY: tuple[str, ...] = (
    "retry_after_s",
    "health.*",
    "upstream.*",
    "client.*",
    "index_watch.*",
    "responses.*",
    "index.*",
)
"""Settings read from the config file and ``KVGATE_*`` only (unless a group names them)."""
OTHER = "other settings"


@dataclass(frozen=True)
class _Flag:
    dest: str  # dotted path in the settings, e.g. "health.interval_s"
    info: FieldInfo
    env: str


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
    shown = "" if default in (None, [], {}) else f"default: {_shown(flag, default)}; "
    return f"{text} ({shown}env {flag.env})".replace("%", "%%")


def _shown(flag: _Flag, default: Any) -> str:
    """A default as the user would write it: JSON for structured settings (enum members as
    their values, never their Python repr), plain text otherwise."""
    if not _is_structured(flag.info.annotation):
        return str(default.value if isinstance(default, enum.Enum) else default)
    plain = TypeAdapter[Any](flag.info.annotation or Any).dump_python(default, mode="json")
    return msgspec.json.encode(plain).decode()


def _matches(dest: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(dest, pattern) for pattern in patterns)


def grouped(settings_model: type[BaseModel]) -> tuple[list[tuple[str, list[_Flag]]], list[_Flag]]:
    """The flags of ``settings_model`` in their ``--help`` groups (in order, the "other
    settings" last when any), and the settings without a flag (``FILE_ONLY``)."""
    flags = list(_fields(settings_model))
    placed: set[str] = set()
    groups: list[tuple[str, list[_Flag]]] = []
    for title, patterns in GROUPS:
        members: list[_Flag] = []
        for pattern in patterns:
            for flag in flags:
                if flag.dest not in placed and fnmatch.fnmatchcase(flag.dest, pattern):
                    members.append(flag)
                    placed.add(flag.dest)
        groups.append((title, members))
    rest = [f for f in flags if f.dest not in placed]
    file_only = [f for f in rest if _matches(f.dest, FILE_ONLY)]
    other = [f for f in rest if not _matches(f.dest, FILE_ONLY)]
    if other:
        groups.append((OTHER, other))
    return groups, file_only


def _option(flag: _Flag) -> str:
    name = flag.dest.split(".")[-1] if "." not in flag.dest else flag.dest
    return "--" + name.replace(".", "-").replace("_", "-")


def _add(group: argparse._ArgumentGroup, flag: _Flag) -> None:
    option = _option(flag)
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
        group.add_argument(option, dest=flag.dest, help=_help(flag), **_shape(flag.info))


def add_settings_flags(
    parser: argparse.ArgumentParser,
    settings_model: type[BaseModel],
    first: argparse._ArgumentGroup | None = None,
) -> None:
    """Every setting with a flag, in the ``--help`` groups; ``first``: the group holding
    the options the caller added before (``--config``), used for the first group."""
    groups, file_only = grouped(settings_model)
    for index, (title, members) in enumerate(groups):
        group = first if index == 0 and first is not None else parser.add_argument_group(title)
        if index == 0 and first is not None:
            group.title = title
        for flag in members:
            _add(group, flag)
    parser.add_argument(
        "--help-all",
        action=_FileOnlyHelp,
        nargs=0,
        default=SUPPRESS,
        help=f"also list the {len(file_only)} settings read only from --config and KVGATE_* "
        "(bounds on what engines send, connection pools, the index's internals)",
        settings=file_only,
    )


class _FileOnlyHelp(argparse.Action):
    """``--help-all``: the usual help, then every config-file-only setting."""

    def __init__(self, *args: Any, settings: list[_Flag], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._settings = settings

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        lines = [parser.format_help(), "settings read only from --config and KVGATE_*:"]
        for flag in self._settings:
            lines.append(f"  {flag.dest}")
            lines.append(f"      {_help(flag).replace('%%', '%')}")
        print("\n".join(lines))
        parser.exit()


def add_moved_flags(
    parser: argparse.ArgumentParser,
    settings_model: type[BaseModel],
    moved: Mapping[tuple[str, str], tuple[str, ...]],
) -> None:
    """Hidden flags for settings that moved: ``--section-name`` still sets the setting at its
    new place (its help is the new flag's)."""
    flags = {flag.dest: flag for flag in _fields(settings_model)}
    for (section, name), target in moved.items():
        flag = flags[".".join(target)]
        option = f"--{section}-{name}".replace("_", "-")
        if _is_bool(flag.info.annotation):
            parser.add_argument(
                option, dest=flag.dest, action=argparse.BooleanOptionalAction, help=SUPPRESS
            )
        else:
            parser.add_argument(option, dest=flag.dest, help=SUPPRESS, **_shape(flag.info))


def _shape(info: FieldInfo) -> dict[str, Any]:
    """Metavar (and choices) of a scalar flag from its annotation (or its ``metavar`` or
    ``choices`` in ``json_schema_extra``)."""
    extra = info.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("metavar"), str):
        return {"metavar": extra["metavar"]}
    choices = extra.get("choices") if isinstance(extra, dict) else None
    if isinstance(choices, list):
        return {"choices": list(choices)}
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
