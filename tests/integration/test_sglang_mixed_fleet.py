"""One kvgate in front of a real vLLM replica and a real SGLang replica of the same tiny model
(issue 50, part 1), at its defaults: no ``--tokenizer``, no block size.

Both engines declare 32 tokens a block (vLLM's ``--block-size``, SGLang's ``--page-size``) and
kvgate adopts it; each prompt is tokenized by each engine kind (their ``/tokenize``) and each
worker is credited only with blocks keyed as its own engine tokenizes the prompt. So kvgate's
prediction equals what each engine reports as cached, on either engine: with the model's own
chat template on both (they agree), and with an SGLang replica serving a variant of it (no BOS:
every chat's tokens differ), where SGLang holding vLLM's tokens of a chat earns it no credit.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from kvgate_server import KvgateServer, matched_blocks, route_explain
from sglang_helpers import (
    PAGE,
    Turn,
    next_chat,
    plan_free_sglang,
    turn,
    wait_indexed,
    worker_view,
)
from vllm_helpers import MODEL, ChatSession

from kvgate.backends.process import PortAllocator, wait_until
from kvgate.backends.sglang_cpu.launch import SglangFleet, SglangOptions, SglangStartError
from kvgate.backends.sglang_cpu.layout import SglangLayout
from kvgate.backends.vllm_cpu.launch import Fleet

pytestmark = [pytest.mark.sglang, pytest.mark.vllm]

SESSIONS = 6
TURNS = 4
KINDS = ("chat", "completion")


@pytest.fixture(scope="module")
def sglang_without_bos(
    sglang_layout: SglangLayout,
    sglang_model_dir: Path,
    ports: PortAllocator,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SglangFleet]:
    """One more SGLang replica of the tiny model, serving its chat template without the BOS
    token (``--chat-template``): its tokens of every chat differ from vLLM's."""
    config = json.loads((sglang_model_dir / "tokenizer_config.json").read_text())
    variant = config["chat_template"].replace("{{ bos_token }}", "")
    assert variant != config["chat_template"]
    template = tmp_path_factory.mktemp("template") / "no-bos.jinja"
    template.write_text(variant)
    options = SglangOptions(
        python=sglang_layout.python,
        model_dir=sglang_model_dir,
        logs=sglang_layout.logs / "pytest",
        extra_args=("--chat-template", str(template)),
    )
    fleet = SglangFleet(options, plan_free_sglang(1, ports, first=2))
    try:
        fleet.start(ready_timeout=420.0)
    except SglangStartError as exc:
        pytest.fail(f"the SGLang variant did not start: {exc}", pytrace=False)
    try:
        yield fleet
    finally:
        fleet.stop()


def _run_sessions(
    client: httpx.Client, engine_of: dict[str, str], prefix: str, seed: int
) -> tuple[list[Turn], int]:
    """Interleaved sessions (chat and completions) through kvgate: every turn, and how many
    chats the engines tokenized differently. Before each chat turn, the engine that never
    served the session has no credit for it."""
    sessions = [ChatSession.start(f"{prefix}-{i}", seed=seed + i) for i in range(SESSIONS)]
    turns: list[Turn] = []
    disagreed = 0
    homes: dict[str, str] = {}
    for index in range(TURNS):
        for number, session in enumerate(sessions):
            kind = KINDS[number % 2]
            if index and kind == "chat":
                explained = route_explain(client, next_chat(session), session.name)
                assert explained["tokenize_mode"] == "engine"
                disagreed += bool(explained["engines_tokenizing_otherwise"])
                (away,) = set(engine_of) - {homes[session.name]}
                if away not in {t.worker for t in turns if t.session == session.name}:
                    assert matched_blocks(explained, away) == 0, explained
            done = turn(client, session, index, kind, max_tokens=8)
            turns.append(done)
            homes[session.name] = done.worker
            if kind == "chat":
                wait_indexed(client, session, done.worker)
    return turns, disagreed


def _summary(turns: list[Turn], engine_of: dict[str, str]) -> str:
    parts = []
    for engine in ("vllm", "sglang"):
        done = [t for t in turns if engine_of[t.worker] == engine]
        exact = sum(t.predicted == t.cached for t in done)
        parts.append(f"{engine} served {len(done)} (predicted == cached on {exact})")
    return ", ".join(parts)


def _check(turns: list[Turn], engine_of: dict[str, str]) -> None:
    mismatches = [t for t in turns if t.predicted != t.cached]
    assert not mismatches, json.dumps([t.describe() for t in mismatches], indent=1)
    assert {engine_of[t.worker] for t in turns} == {"vllm", "sglang"}, "both engines served"
    assert sum(t.cached for t in turns) > 0


def _gate(
    vllm_fleet: Fleet, sglang: SglangFleet, layout: SglangLayout, ports: PortAllocator, name: str
) -> KvgateServer:
    flags = [vllm_fleet.replicas[0].spec.worker_flag(), sglang.replicas[0].spec.worker_flag()]
    log_path = layout.logs / "pytest" / f"kvgate-{name}.log"
    return KvgateServer(flags, None, log_path, ports.one(), ("--log-level", "debug"), None)


def test_a_mixed_fleet_is_keyed_per_engine_and_predicted_exactly(
    vllm_fleet: Fleet,
    sglang_fleet: SglangFleet,
    sglang_layout: SglangLayout,
    ports: PortAllocator,
    report: Callable[[str], None],
) -> None:
    vllm_url, sglang_url = vllm_fleet.urls[0], sglang_fleet.urls[0]
    engine_of = {vllm_url: "vllm", sglang_url: "sglang"}
    with (
        _gate(vllm_fleet, sglang_fleet, sglang_layout, ports, "mixed-fleet") as gate,
        httpx.Client(base_url=gate.url, timeout=120.0) as client,
    ):
        for url, engine in engine_of.items():
            view = worker_view(client, url)
            assert (view["engine"], view["block_size"], view["ready"]) == (engine, PAGE, True)
        turns, disagreed = _run_sessions(client, engine_of, "mixed", 7600)
    report(f"mixed fleet: {_summary(turns, engine_of)}; chats tokenized differently: {disagreed}")
    _check(turns, engine_of)
    assert disagreed == 0  # one chat template: the engines agree


def test_where_the_engines_tokenize_differently_neither_is_credited_with_the_other(
    vllm_fleet: Fleet,
    sglang_without_bos: SglangFleet,
    sglang_layout: SglangLayout,
    ports: PortAllocator,
    report: Callable[[str], None],
) -> None:
    vllm_url, sglang_url = vllm_fleet.urls[0], sglang_without_bos.urls[0]
    engine_of = {vllm_url: "vllm", sglang_url: "sglang"}
    session = ChatSession.start("mixed-differ", seed=7700)
    messages = session.ask(120)
    chat = {"model": MODEL, "messages": messages, "max_tokens": 1}
    with (
        _gate(vllm_fleet, sglang_without_bos, sglang_layout, ports, "mixed-differ") as gate,
        httpx.Client(base_url=gate.url, timeout=120.0) as client,
    ):
        vllm_ids = httpx.post(f"{vllm_url}/tokenize", json=chat, timeout=30.0).json()["tokens"]
        sglang_ids = httpx.post(f"{sglang_url}/tokenize", json=chat, timeout=30.0).json()["tokens"]
        assert vllm_ids[1:] == sglang_ids and vllm_ids != sglang_ids  # the BOS only
        # SGLang holds vLLM's tokens of the chat (sent to it as token ids)...
        as_ids = {"model": MODEL, "prompt": vllm_ids, "max_tokens": 1}
        httpx.post(f"{sglang_url}/v1/completions", json=as_ids, timeout=60.0).raise_for_status()
        wait_until(
            lambda: matched_blocks(route_explain(client, as_ids), sglang_url) > 0,
            15.0,
            "kvgate to index vLLM's tokens of the chat on SGLang",
        )
        # ...and is credited with none of them for the chat itself, which it tokenizes otherwise
        explained = route_explain(client, chat, session.name)
        assert explained["engines_tokenizing_otherwise"] in (["sglang"], ["vllm"]), explained
        assert matched_blocks(explained, sglang_url) == 0, explained
        first = turn(client, session, 0)  # (asks one more question first)
        assert first.predicted == first.cached, first.describe()
        turns, disagreed = _run_sessions(client, engine_of, "mixed-differ", 7710)
    report(
        f"mixed fleet, SGLang without BOS: {_summary(turns, engine_of)}; chats tokenized "
        f"differently: {disagreed}"
    )
    _check(turns, engine_of)
    assert disagreed > 0
