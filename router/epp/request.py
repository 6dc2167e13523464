"""What one request's head and body say, for the pick: its model, prompt, session, output
limit, whether it streams, and how kvgate learns its usage from the answer.

The body is parsed as ``kvgate serve`` parses it (``router.requests``): a chat or text
completion is keyed; a Responses API body is keyed when kvgate renders it as the engine does,
and one naming a ``previous_response_id`` goes to the worker holding it; any other ``/v1``
body only names its model (placed by load); a request without a body takes its model from
the ``model`` query parameter. A streamed answer's usage is asked for upstream and hidden
from the client, as ``serve`` does, where kvgate forwards the answer's bytes itself (Envoy's
full-duplex streamed mode): elsewhere only a client's own request for usage shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from kvgate.index.api import PromptInput
from kvgate.router.errors import InvalidRequest
from kvgate.router.proxy import UsageMode
from kvgate.router.requests import (
    AnyModelBody,
    ChatBody,
    CompletionBody,
    ResponsesBody,
    decode_json_object,
    raw_with_usage_requested,
    validate,
)

MAX_QUERY = 4096  # characters of a query string read for its ``model``


@dataclass(frozen=True, slots=True)
class Head:
    """The request's pseudo-headers and the ones kvgate reads."""

    method: str
    path: str  # without the query
    query: str
    headers: dict[str, str]

    @classmethod
    def of(cls, headers: dict[str, str]) -> Head:
        target = headers.get(":path", "/")
        parts = urlsplit(target)
        return cls(headers.get(":method", "GET"), parts.path, parts.query[:MAX_QUERY], headers)

    @property
    def lists_models(self) -> bool:
        """``GET /v1/models[/...]``: answered from the registry, as ``serve`` does."""
        return self.method == "GET" and (
            self.path == "/v1/models" or self.path.startswith("/v1/models/")
        )


@dataclass(frozen=True, slots=True)
class Parsed:
    """A request as the pick and the answer's accounting need it."""

    model: str
    prompt: PromptInput | None
    session: str | None
    max_tokens: int | None
    stream: bool
    usage: UsageMode
    body: bytes | None  # the body to send upstream when kvgate changed it, else None
    previous_response_id: str | None = None
    responses: bool = False  # a stored Responses API answer: kvgate notes its response id
    queued: bool = True  # through the admission queue (work for an engine)


KEYED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


def parse(
    head: Head, raw: bytes, *, capture_usage: bool, can_rewrite: bool, model: str | None = None
) -> Parsed:
    """``InvalidRequest`` / ``InvalidJSON`` (400) for what ``serve`` refuses.
    ``can_rewrite``: kvgate sends the body and the answer back itself (it may ask for
    usage upstream and hide it from the client); ``model``: the model of a path that is
    not keyed, when known (a stored response's)."""
    session = head.headers.get("x-session-id")
    if head.path in {"/v1/chat/completions", "/v1/completions"}:
        kind: type[ChatBody | CompletionBody]
        kind = ChatBody if head.path == "/v1/chat/completions" else CompletionBody
        data = decode_json_object(raw)
        body = validate(kind, data)
        stream = bool(body.stream)
        usage, rewritten = UsageMode.BODY, None
        if stream:
            asked = body.stream_options is not None and body.stream_options.include_usage
            if asked:
                usage = UsageMode.TAP
            elif capture_usage and can_rewrite:
                usage, rewritten = UsageMode.HIDE, raw_with_usage_requested(raw, data)
            else:
                usage = UsageMode.NONE
        return Parsed(
            body.model,
            body.prompt_input(),
            session or body.user,
            body.output_limit,
            stream,
            usage,
            rewritten,
        )
    if head.path == "/v1/responses":
        data = decode_json_object(raw)
        if "request_id" in data:  # vLLM makes it the response id: refused as serve does
            raise InvalidRequest(
                "request_id: kvgate does not take a client-chosen request_id on "
                "/v1/responses (the engine would use it as the response id); leave it out",
                param="request_id",
            )
        responses = validate(ResponsesBody, data)
        prompt, _ = responses.prompt_input()
        stream = bool(responses.stream)
        return Parsed(
            responses.model,
            prompt,
            session or responses.user,
            responses.output_limit,
            stream,
            UsageMode.TAP if stream else UsageMode.BODY,
            None,
            previous_response_id=responses.previous_response_id,
            responses=responses.store is not False,  # store=false: its id is not recorded
        )
    model = model or _model_of(head, raw)
    return Parsed(
        model, None, session, None, False, UsageMode.NONE, None, queued=head.method == "POST"
    )


def _model_of(head: Head, raw: bytes) -> str:
    if raw.strip():
        return validate(AnyModelBody, decode_json_object(raw)).model
    models = parse_qs(head.query, max_num_fields=64).get("model")
    if not models or not models[0]:
        raise InvalidRequest("model: a model is required to choose a worker", param="model")
    return models[0]
