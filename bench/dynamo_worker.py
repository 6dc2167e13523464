"""A Dynamo worker in front of one OpenAI-compatible replica (run in the Dynamo venv).

Registered with Dynamo as a token-in, token-out engine: Dynamo's frontend tokenizes, its KV
router picks this worker, and ``generate`` forwards the token ids to the replica's
``/v1/completions`` (streaming), relaying each chunk's tokens and, last, the replica's usage
(prompt and cached tokens). The replica's ZMQ KV events reach Dynamo's router through the
``KvEventPublisher`` Dynamo's worker runtime starts for the ``ZmqSource`` this engine declares
(the same relay Dynamo's own vLLM worker uses), so the router's index holds the replica's
cache. Started by bench/dynamo_peer.py; imports only what the Dynamo venv has.

Everything read from the replica is bounded: a line of at most ``MAX_LINE`` bytes, at most
``max_tokens`` + ``CHUNK_SLACK`` chunks per answer.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncGenerator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from dynamo.common.backend.engine import (
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
)
from dynamo.common.backend.publisher import KvEventSource, ZmqSource
from dynamo.common.backend.run import run
from dynamo.common.backend.worker import WorkerConfig
from tokenizers import Tokenizer

MAX_LINE = 1 << 20
CHUNK_SLACK = 64
DEFAULT_MAX_TOKENS = 16


def completion_body(
    request: Mapping[str, Any], model: str, token_ids: bool = False
) -> dict[str, Any]:
    """The replica's ``/v1/completions`` body for one Dynamo request (token ids in; with
    ``token_ids``, ask for the output's ids: vLLM's ``return_token_ids``)."""
    stop = request.get("stop_conditions") or {}
    sampling = request.get("sampling_options") or {}
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request["token_ids"]),
        "max_tokens": stop.get("max_tokens") or DEFAULT_MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": sampling.get("temperature") or 0.0,
    }
    if token_ids:
        body["return_token_ids"] = True
    if stop.get("ignore_eos"):
        body["ignore_eos"] = True
    return body


def chunk_tokens(choice: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    """A streamed choice's token ids: as the replica reports them (vLLM with
    ``return_token_ids``), else its text tokenized (the simulator: one word, one token)."""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return ids
    text = choice.get("text")
    if isinstance(text, str) and text:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    return []


def sse_payload(line: bytes) -> dict[str, Any] | None:
    """The JSON object of one ``data:`` line (``None`` for other lines and ``[DONE]``)."""
    text = line.decode("utf-8", errors="replace").strip()
    if not text.startswith("data:"):
        return None
    data = text[5:].strip()
    if data == "[DONE]":
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class ForwardingEngine(LLMEngine):
    """Forwards to one replica; its KV events come from the replica's publisher."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tokenizer = Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json"))
        self.session: aiohttp.ClientSession | None = None

    @classmethod
    async def from_args(
        cls, argv: list[str] | None = None
    ) -> tuple[ForwardingEngine, WorkerConfig]:
        p = argparse.ArgumentParser(description=__doc__)
        p.add_argument("--replica", required=True, help="the replica's base URL")
        p.add_argument("--events", required=True, help="the replica's ZMQ KV-event endpoint")
        p.add_argument("--topic", default="", help="the replica's KV-event topic")
        p.add_argument("--model-dir", required=True, help="tokenizer + config.json")
        p.add_argument("--model", required=True, help="served model name")
        p.add_argument("--block-size", type=int, required=True, help="the replica's KV block")
        p.add_argument("--namespace", required=True)
        p.add_argument(
            "--return-token-ids",
            action="store_true",
            help="the replica reports output token ids (vLLM); else its text is tokenized",
        )
        args = p.parse_args(argv)
        config = WorkerConfig(
            namespace=args.namespace,
            component="backend",
            endpoint="generate",
            model_name=args.model_dir,
            served_model_name=args.model,
            endpoint_types="chat,completions",
            discovery_backend="file",
            request_plane="tcp",
            event_plane="zmq",
        )
        return cls(args), config

    async def start(self, worker_id: int) -> EngineConfig:
        del worker_id
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self.session = aiohttp.ClientSession(timeout=timeout, read_bufsize=MAX_LINE)
        return EngineConfig(
            model=self.args.model_dir,
            served_model_name=self.args.model,
            llm=LlmRegistration(kv_cache_block_size=self.args.block_size),
        )

    async def kv_event_sources(self) -> list[KvEventSource]:
        return [ZmqSource(endpoint=self.args.events, topic=self.args.topic)]

    async def generate(
        self, request: GenerateRequest, context: Any
    ) -> AsyncGenerator[GenerateChunk, None]:
        if self.session is None:
            raise RuntimeError("generate before start")
        body = completion_body(request, self.args.model, self.args.return_token_ids)
        limit = int(body["max_tokens"]) + CHUNK_SLACK
        finish: str | None = None
        usage: dict[str, Any] | None = None
        async with self.session.post(f"{self.args.replica}/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = (await resp.content.read(4096)).decode(errors="replace")
                yield {"token_ids": [], "index": 0, "finish_reason": f"error: {text}"}
                return
            chunks = 0
            async for line in resp.content:
                payload = sse_payload(line)
                if payload is None:
                    continue
                chunks += 1
                if chunks > limit or context.is_stopped():
                    break
                if isinstance(payload.get("usage"), dict):
                    usage = payload["usage"]
                for choice in payload.get("choices") or []:
                    if not isinstance(choice, dict):
                        continue
                    finish = choice.get("finish_reason") or finish
                    ids = chunk_tokens(choice, self.tokenizer)
                    if ids:
                        yield {"token_ids": ids, "index": 0}
        last: GenerateChunk = {"token_ids": [], "index": 0, "finish_reason": finish or "stop"}
        if usage is not None:
            last["completion_usage"] = usage
        yield last

    async def cleanup(self) -> None:
        if self.session is not None:
            await self.session.close()


if __name__ == "__main__":
    run(ForwardingEngine)
