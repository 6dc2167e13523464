"""The HTTP face of one replica: a lean ASGI app (served by uvicorn) speaking vLLM's API.

OpenAI: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming or not, with
``usage.prompt_tokens_details.cached_tokens``), ``POST /v1/responses``,
``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``, ``GET /v1/models``. vLLM:
``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``,
``POST /v1/completions/render``, ``POST /v1/chat/completions/render``,
``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``, ``GET /kv_event_sources``,
``POST /reset_prefix_cache``, ``GET /version``. Simulator: ``POST /sim/fault``,
``GET /sim/state``.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate.backends.sim import trtllm
from kvgate.backends.sim.engine import Engine, RequestFault, SimRequest
from kvgate.backends.sim.faults import FaultError
from kvgate.backends.sim.lora import Adapter, LoraError
from kvgate.backends.sim.protocol import (
    ApiError,
    ResponseShape,
    check_length,
    get_bool,
    json_encode,
    model_not_found,
    parse_messages,
    parse_object,
    parse_prompt,
    parse_sampling,
    parse_tools,
    render_request,
)
from kvgate.backends.sim.responses import (
    ResponseObject,
    chat_tools,
    conversation,
    not_found,
    parse_request,
)
from kvgate.backends.sim.streaming import (
    JSON_HEADERS,
    ChatFramer,
    Framer,
    Generation,
    Receive,
    ResponsesFramer,
    Scope,
    Send,
    respond,
)
from kvgate.backends.sim.transfer import (
    TRANSFER_US_PER_TOKEN,
    bootstrap_of,
    produced,
    pull,
    pull_room,
    transfer_mode,
    with_params,
)
from kvgate.index.errors import TemplateError

if TYPE_CHECKING:
    from kvgate.backends.sim.replica import SimReplica

Handler = Callable[[Scope, bytes, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 64 * 1024 * 1024
VERSION = "kvgate-sim 0.1.0"
_RESPONSES = "/v1/responses/"
_DP_RANK_HEADER = b"x-data-parallel-rank"  # the target rank (vLLM and SGLang)
_VLLM_ONLY = (
    "/tokenize",
    "/detokenize",
    "/kv_event_sources",
    "/v1/completions/render",
    "/v1/chat/completions/render",
)


async def _json(send: Send, payload: Any, status: int = 200) -> None:
    await respond(send, status, json_encode(payload), JSON_HEADERS)


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _lora_error(exc: LoraError) -> ApiError:
    return ApiError(exc.status, exc.message, kind=exc.kind)


class ReplicaApp:
    """ASGI application of one simulated replica."""

    def __init__(self, replica: SimReplica) -> None:
        self._replica = replica
        self._routes: dict[tuple[str, str], Handler] = {
            ("GET", "/health"): self._health,
            ("GET", "/ping"): self._health,
            ("GET", "/version"): self._version,
            ("GET", "/v1/models"): self._models,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/kv_event_sources"): self._kv_event_sources,
            ("GET", "/sim/state"): self._state,
            ("POST", "/sim/fault"): self._fault,
            ("POST", "/reset_prefix_cache"): self._reset_prefix_cache,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/detokenize"): self._detokenize,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/responses"): self._responses,
            ("POST", "/v1/completions/render"): self._render_completion,
            ("POST", "/v1/chat/completions/render"): self._render_chat,
            ("POST", "/v1/load_lora_adapter"): self._load_lora,
            ("POST", "/v1/unload_lora_adapter"): self._unload_lora,
            ("POST", "/sim/kv_transfer/pull"): self._pull,
        }
        if replica.config.api.engine_kind == "trtllm":
            self._as_trtllm()
        self._paths = {path for _, path in self._routes}

    def _as_trtllm(self) -> None:
        """trtllm-serve's surface: Prometheus at its own path, JSON stats at /metrics, a
        generating health check; none of vLLM's tokenizer, renderer or event sources."""
        for path in _VLLM_ONLY:
            self._routes.pop(("POST", path), None)
            self._routes.pop(("GET", path), None)
        self._routes[("GET", "/metrics")] = self._iteration_stats
        self._routes[("GET", trtllm.PROMETHEUS_PATH)] = self._trtllm_metrics
        self._routes[("GET", "/health_generate")] = self._health_generate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        handler = self._route(scope["method"], scope["path"])
        try:
            body = await _read_body(receive) if scope["method"] == "POST" else b""
            await handler(scope, body, receive, send)
        except ApiError as exc:
            await respond(send, exc.status, exc.body(), JSON_HEADERS)
        except ConnectionAbortedError:
            return

    def _route(self, method: str, path: str) -> Handler:
        handler = self._routes.get((method, path))
        if handler is not None:
            return handler
        if path.startswith(_RESPONSES) and len(path) > len(_RESPONSES):
            cancel = path.endswith("/cancel")
            if (method, cancel) in (("GET", False), ("POST", True)):
                return self._cancel_response if cancel else self._get_response
            return self._refuse(405, f"method {method} not allowed")
        if path in self._paths:
            return self._refuse(405, f"method {method} not allowed")
        return self._refuse(404, f"no route {path}")

    @staticmethod
    def _refuse(status: int, message: str) -> Handler:
        async def refuse(scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
            raise ApiError(status, message)

        return refuse

    def _served(self, data: Mapping[str, Any]) -> tuple[str, Adapter | None]:
        """The model a body names: the served model (also when it names none) or an adapter;
        vLLM's 404 for anything else."""
        base = self._replica.config.engine.model
        name = data.get("model")
        if name is None or name == base:
            return base, None
        if not isinstance(name, str):
            raise ApiError(400, "'model' must be a string", "model")
        adapter = self._replica.adapters.get(name)
        if adapter is None:
            raise model_not_found(name)
        return name, adapter

    # --- plain endpoints -----------------------------------------------------------------

    async def _health(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        await respond(send, 200, b"", [])

    async def _version(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        await _json(send, {"version": VERSION})

    async def _models(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        replica = self._replica
        cfg = replica.config.engine
        owner = replica.config.api.owned_by

        def card(name: str, root: str, parent: str | None, max_len: int | None) -> Any:
            return {
                "id": name, "object": "model", "created": replica.started_at,
                "owned_by": owner, "root": root, "parent": parent, "max_model_len": max_len,
            }  # fmt: skip

        cards = [card(cfg.model, cfg.model, None, cfg.effective_max_model_len)]
        cards += [card(a.name, a.path, cfg.model, None) for a in replica.adapters]
        await _json(send, {"object": "list", "data": cards})

    async def _trtllm_metrics(
        self, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        payload = trtllm.prometheus_page(self._replica)
        await respond(send, 200, payload, [(b"content-type", CONTENT_TYPE_LATEST.encode())])

    async def _iteration_stats(
        self, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        await _json(send, trtllm.iteration_stats(self._replica))

    async def _health_generate(
        self, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        await respond(send, 200, b"Generation health check OK", [])

    async def _metrics(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        payload = generate_latest(self._replica.registry)
        await respond(send, 200, payload, [(b"content-type", CONTENT_TYPE_LATEST.encode())])

    async def _kv_event_sources(
        self, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        await _json(send, self._replica.kv_event_sources())

    async def _state(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        await _json(send, self._replica.state())

    async def _fault(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        try:
            result = await self._replica.apply_fault(parse_object(body))
        except FaultError as exc:
            raise ApiError(400, str(exc)) from exc
        await _json(send, result)

    async def _reset_prefix_cache(
        self, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        if not self._replica.reset_prefix_cache():
            raise ApiError(409, "blocks are in use: the prefix cache was not reset")
        await respond(send, 200, b"", [])

    # --- LoRA adapters -------------------------------------------------------------------

    async def _load_lora(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        data = parse_object(body)
        name, path = data.get("lora_name"), data.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise ApiError(400, "'lora_name' and 'lora_path' must be strings")
        in_place = get_bool(data, "load_inplace", False)
        try:
            self._replica.adapters.load(name, path, in_place=in_place)
        except LoraError as exc:
            raise _lora_error(exc) from exc
        await respond(send, 200, f"Success: LoRA adapter '{name}' added successfully.".encode(), [])

    async def _unload_lora(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        name = parse_object(body).get("lora_name")
        if not isinstance(name, str):
            raise ApiError(400, "'lora_name' must be a string", "lora_name")
        try:
            self._replica.adapters.unload(name)
        except LoraError as exc:
            raise _lora_error(exc) from exc
        message = f"Success: LoRA adapter '{name}' removed successfully."
        await respond(send, 200, message.encode(), [])

    # --- tokenization --------------------------------------------------------------------

    async def _render_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        data: Mapping[str, Any],
    ) -> list[int]:
        """Token ids of chat ``messages`` rendered by the chat template."""
        tok = self._replica.tokenizer
        try:
            text = tok.render_chat(
                messages,
                tools=tools,
                add_generation_prompt=get_bool(data, "add_generation_prompt", True),
                continue_final_message=get_bool(data, "continue_final_message", False),
                template_kwargs=data.get("chat_template_kwargs") or None,
            )
        except TemplateError as exc:
            raise ApiError(400, str(exc), "messages") from exc
        return await tok.encode_async(text)

    async def _prompt_ids(self, data: Mapping[str, Any], chat: bool) -> list[int]:
        """Token ids of a request: chat ``messages`` (rendered) or a completion ``prompt``."""
        if chat:
            return await self._render_ids(parse_messages(data), parse_tools(data), data)
        tok = self._replica.tokenizer
        prompt = parse_prompt(data, tok.vocab_size)
        return prompt if isinstance(prompt, list) else await tok.encode_async(prompt)

    async def _tokenize(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        data = parse_object(body)
        self._served(data)
        ids = await self._prompt_ids(data, chat="messages" in data)
        tok = self._replica.tokenizer
        strs = (
            [tok.token_text(i) for i in ids] if get_bool(data, "return_token_strs", False) else None
        )
        await _json(
            send,
            {
                "count": len(ids),
                "max_model_len": self._replica.config.engine.effective_max_model_len,
                "tokens": ids,
                "token_strs": strs,
            },
        )

    async def _detokenize(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        data = parse_object(body)
        self._served(data)
        tokens = data.get("tokens")
        tok = self._replica.tokenizer
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tok.vocab_size
            for t in tokens
        ):
            raise ApiError(400, "'tokens' must be an array of token ids", "tokens")
        await _json(send, {"prompt": tok.decode(tokens)})

    async def _render(self, body: bytes, chat: bool) -> dict[str, Any]:
        data = parse_object(body)
        model, _ = self._served(data)
        sampling = parse_sampling(data, self._default_max_tokens(chat), chat=chat)
        ids = await self._prompt_ids(data, chat)
        return render_request(ids, model, sampling.max_tokens, sampling.stream)

    async def _render_completion(
        self, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        await _json(send, [await self._render(body, chat=False)])

    async def _render_chat(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        await _json(send, await self._render(body, chat=True))

    # --- generation ----------------------------------------------------------------------

    def _default_max_tokens(self, chat: bool) -> int:
        return self._replica.config.engine.default_max_tokens if chat else 16

    def _check_fail(self) -> None:
        fault = self._replica.faults.hit("fail")
        if fault is not None:
            self._replica.metrics.on_fault("fail")
            raise ApiError(int(fault.value), "simulated failure (fault 'fail')")

    def _submit(
        self,
        scope: Scope,
        ids: list[int],
        max_tokens: int,
        *,
        salt: str | None,
        arrival: float,
        adapter: Adapter | None,
        param: str = "max_tokens",
        remote_tokens: int = 0,
        keep: bool = False,
    ) -> tuple[Engine, SimRequest]:
        """Into the engine of the rank it asks for (else the least loaded), with the
        ``abort`` fault drawn for it if one is standing (``remote_tokens``: a decode leg's
        transferred prompt tokens; ``keep``: a prefill leg's blocks kept for a transfer)."""
        replica = self._replica
        engine = replica.engine_for(self._dp_rank(scope))
        check_length(len(ids), max_tokens, replica.config.engine.effective_max_model_len, param)
        abort = replica.faults.hit("abort")
        fault = None
        if abort is not None:
            replica.metrics.on_fault("abort")
            fault = RequestFault(int(abort.value), abort.drop)
        return engine, engine.submit(
            ids,
            max_tokens,
            salt,
            arrival,
            lora=adapter,
            fault=fault,
            remote_tokens=remote_tokens,
            keep=keep,
        )

    def _dp_rank(self, scope: Scope) -> int | None:
        """The ``X-data-parallel-rank`` header's rank (None: absent or not an integer, as
        vLLM reads it); a rank the server does not have is a 400."""
        raw = next((v for k, v in scope["headers"] if k.lower() == _DP_RANK_HEADER), None)
        if raw is None or self._replica.config.api.engine_kind == "trtllm":
            return None
        try:
            rank = int(raw.decode("latin-1").strip())
        except ValueError:
            return None
        if not 0 <= rank < len(self._replica.ranks):
            raise ApiError(400, f"data parallel rank {rank} is out of range", "dp_rank")
        return rank

    async def _serve(
        self,
        submitted: tuple[Engine, SimRequest],
        framer: Framer,
        *,
        stream: bool,
        asgi: tuple[Scope, Receive, Send],
    ) -> None:
        replica = self._replica
        at_accept = replica.config.api.stream_open == "at_accept"
        engine, req = submitted
        generation = Generation(engine, req, *asgi)
        await generation.serve(framer, stream=stream, at_accept=at_accept)

    def _text(self, token_ids: Sequence[int], leading_space: bool) -> str:
        tok = self._replica.tokenizer
        text = " ".join(tok.token_text(t) for t in token_ids)
        return " " + text if leading_space and text else text

    async def _chat(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        await self._generate(scope, body, receive, send, chat=True)

    async def _completions(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        await self._generate(scope, body, receive, send, chat=False)

    async def _generate(
        self, scope: Scope, body: bytes, receive: Receive, send: Send, *, chat: bool
    ) -> None:
        arrival = time.monotonic()
        data = parse_object(body)
        model, adapter = self._served(data)
        sampling = parse_sampling(data, self._default_max_tokens(chat), chat=chat)
        self._check_fail()
        ids = await self._prompt_ids(data, chat)
        transfer = transfer_mode(data)
        bootstrap = bootstrap_of(data)
        room = None
        if bootstrap is not None and self._own_address(bootstrap):
            room = bootstrap[2]  # SGLang's prefill leg: this replica is the bootstrap server
        remote = 0
        if transfer is not None and transfer[0] == "consume":
            remote = await self._receive_kv(transfer[1], ids)
        elif bootstrap is not None and room is None:
            remote = await self._receive_kv(bootstrap, ids)
        produce = (transfer is not None and transfer[0] == "produce") or room is not None
        # SGLang's prefill server computes the prompt and its first token only, whatever the
        # request's max_tokens: the decode server generates the answer
        submitted = self._submit(
            scope,
            ids,
            1 if room is not None else sampling.max_tokens,
            salt=sampling.cache_salt,
            arrival=arrival,
            adapter=adapter,
            remote_tokens=remote,
            keep=produce,
        )
        framer: Framer = ChatFramer(ResponseShape.new(chat, model), sampling, self._text)
        if produce:
            framer = _ProducerFramer(framer, self._replica, submitted[1], room)
        await self._serve(submitted, framer, stream=sampling.stream, asgi=(scope, receive, send))

    def _own_address(self, bootstrap: tuple[str, int, int]) -> bool:
        replica = self._replica
        return (bootstrap[0], bootstrap[1]) == (replica.config.host, replica.http_port)

    async def _receive_kv(
        self, params: dict[str, Any] | tuple[str, int, int], ids: list[int]
    ) -> int:
        """A decode leg: pull its prefill's blocks (``backends/sim/transfer.py``), taking the
        transfer time of their size; the prompt tokens they hold."""
        replica = self._replica
        bs = replica.config.engine.block_size
        if isinstance(params, tuple):
            tokens = await pull_room(replica.pull_client, params, ids, bs)
        else:
            tokens = await pull(replica.pull_client, params, ids, bs)
        seconds = tokens * TRANSFER_US_PER_TOKEN / 1e6 / replica.config.timing.speedup
        if seconds > 0:
            await asyncio.sleep(seconds)  # the modelled transfer (the simulator's clock)
        return tokens

    async def _pull(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """A decode replica pulls the blocks a prefill here kept for it (404: not held)."""
        data = parse_object(body)
        engine, ids = data.get("remote_engine_id"), data.get("remote_block_ids")
        room = data.get("bootstrap_room")
        if type(room) is int:
            lease = await self._replica.leases.take_room(room)
        elif not isinstance(engine, str) or not isinstance(ids, list):
            raise ApiError(400, "expected remote_engine_id and remote_block_ids")
        else:
            lease = self._replica.leases.take(engine, ids)
        if lease is None:
            raise ApiError(404, "no KV transfer holds these blocks")
        await _json(send, {"token_ids": list(lease.token_ids)})

    # --- the Responses API ---------------------------------------------------------------

    async def _responses(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        arrival = time.monotonic()
        data = parse_object(body)
        model, adapter = self._served(data)
        request = parse_request(data)
        store = self._replica.responses
        history = None
        if request.previous_response_id is not None:
            previous = store.get(request.previous_response_id)
            if previous is None:
                raise not_found(request.previous_response_id)
            history = previous.history
        self._check_fail()
        messages = conversation(request, history)
        ids = await self._render_ids(messages, chat_tools(request), {})
        max_tokens = request.max_output_tokens or self._default_max_tokens(chat=True)
        req = self._submit(
            scope, ids, max_tokens, salt=request.cache_salt, arrival=arrival, adapter=adapter,
            param="max_output_tokens",
        )  # fmt: skip
        response = ResponseObject(request, model, max_tokens)

        def done(body: dict[str, Any], text: str) -> None:
            if request.store:
                store.put(response.id, body, [*messages, {"role": "assistant", "content": text}])

        framer = ResponsesFramer(response, self._text, done)
        await self._serve(req, framer, stream=request.stream, asgi=(scope, receive, send))

    def _stored(self, scope: Scope) -> tuple[str, dict[str, Any]]:
        response_id = scope["path"][len(_RESPONSES) :].removesuffix("/cancel")
        stored = self._replica.responses.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return response_id, stored.body

    async def _get_response(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if query.get("stream", ["false"])[-1].lower() == "true":
            raise ApiError(400, "only background responses stream again", "stream")
        await _json(send, self._stored(scope)[1])

    async def _cancel_response(
        self, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        self._stored(scope)
        raise ApiError(
            400, "Cannot cancel a synchronous response.", "response_id", "invalid_request_error"
        )


class _ProducerFramer:
    """A prefill for a remote decode: its whole answer carries the ``kv_transfer_params``
    where the decode replica finds its blocks (kept for a lease when it ends)."""

    def __init__(
        self, inner: Framer, replica: SimReplica, req: SimRequest, room: int | None
    ) -> None:
        self._inner = inner
        self._replica = replica
        self._req = req
        self._room = room  # SGLang's bootstrap room (its answer carries nothing more)

    def opening(self) -> list[bytes]:
        return self._inner.opening()

    def tokens(self, req: SimRequest, new: Sequence[int]) -> list[bytes]:
        return self._inner.tokens(req, new)

    def closing(self, req: SimRequest) -> list[bytes]:
        if self._room is not None:  # SGLang's prefill leg may stream (its router drops it)
            self._keep_room(req, self._room)
        return self._inner.closing(req)

    def error(self, error: ApiError) -> list[bytes]:
        return self._inner.error(error)

    def _keep_room(self, req: SimRequest, room: int) -> None:
        bs = self._replica.config.engine.block_size
        self._replica.leases.keep_room(room, req.token_ids[: len(req.kept or []) * bs])

    def full(self, req: SimRequest) -> bytes:
        if self._room is not None:
            self._keep_room(req, self._room)
            return self._inner.full(req)
        replica = self._replica
        blocks = req.kept or []
        bs = replica.config.engine.block_size
        replica.leases.keep(blocks, req.token_ids[: len(blocks) * bs])
        host = replica.config.host
        params = produced(replica.leases, host, replica.http_port, blocks)
        return with_params(self._inner.full(req), params)
