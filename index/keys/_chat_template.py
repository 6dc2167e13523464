"""Hugging Face compatible chat templates, rendered in a sandboxed jinja2 environment.

Mirrors what vLLM does before tokenizing a chat request: the same environment options as
``transformers`` (``trim_blocks``, ``lstrip_blocks``, loop controls, ``{% generation %}``), the
``tojson`` filter, ``raise_exception`` and ``strftime_now`` globals, the tokenizer's special
tokens as variables, text content parts joined for templates that expect string content, and
tool-call arguments given to the template as objects.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvgate.index.errors import TemplateError

ContentFormat = Literal["string", "openai"]

_CONTENT_LOOP = re.compile(
    r"for\s+\w+\s+in\s+(message|msg|m)(\[['\"]content['\"]\]|\.content)", re.IGNORECASE
)


# What a template (and message preparation) raises on request data it was not written for.
_REQUEST_DATA_ERRORS = (
    TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError,
)  # fmt: skip


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): renders the body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def detect_content_format(source: str) -> ContentFormat:
    """``openai`` when the template iterates over a message's content parts."""
    return "openai" if _CONTENT_LOOP.search(source) else "string"


def _text_of(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
        text = part.get("text")
        return text if isinstance(text, str) else None
    return None


def prepare_messages(
    messages: Sequence[Mapping[str, Any]], content_format: ContentFormat
) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to the template."""
    prepared: list[dict[str, Any]] = []
    for message in messages:
        if type(message) is dict and not _needs_preparing(message):
            prepared.append(message)  # the sandbox keeps templates from changing it
            continue
        item = dict(message)
        content = item.get("content")
        if isinstance(content, list):
            texts = [t for t in (_text_of(p) for p in content) if t is not None]
            if content_format == "string":
                item["content"] = "\n".join(texts)
            else:
                item["content"] = [{"type": "text", "text": t} for t in texts]
        tool_calls = item.get("tool_calls")
        if item.get("role") == "assistant" and isinstance(tool_calls, list):
            item["tool_calls"] = [_parsed_tool_call(call) for call in tool_calls]
        prepared.append(item)
    return prepared


def _needs_preparing(message: Mapping[str, Any]) -> bool:
    return isinstance(message.get("content"), list) or (
        message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list)
    )


def _parsed_tool_call(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
    elif isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # otherwise left as the client sent it
            function["arguments"] = json.loads(arguments)
    return {**call, "function": function}


class ChatTemplate:
    """A compiled chat template and the variables it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, loopcontrols],
            undefined=jinja2.Undefined,
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise TemplateError(f"chat template does not parse: {error}") from error
        # jinja keeps a template's globals as a ChainMap over the environment's, merged in
        # Python code on every render; this environment is private and complete: a dict.
        self._template.globals = dict(self._template.globals)
        self.source = source
        self.content_format = detect_content_format(source)
        self._special = {k: v for k, v in special_tokens.items() if v is not None}

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        variables: dict[str, Any] = dict(self._special)
        if extra:
            variables.update(extra)
        try:
            variables.update(
                messages=prepare_messages(messages, self.content_format),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
            )
            return self._template.render(variables)
        except TemplateError:
            raise
        except jinja2.TemplateError as error:
            raise TemplateError(f"chat template failed: {error}") from error
        except _REQUEST_DATA_ERRORS as error:  # e.g. tool_calls: 5, arguments nested 5000 deep
            raise TemplateError(
                f"chat template failed on this request's data: {error!r}"
            ) from error


def load_template_source(config: Mapping[str, Any], name: str | None = None) -> str | None:
    """The ``chat_template`` of a tokenizer_config.json (a string or a list of named ones)."""
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        chosen = named.get(name or "default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None
