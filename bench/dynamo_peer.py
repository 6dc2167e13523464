"""NVIDIA Dynamo 1.6.1 in benchmarks: its KV router as a peer, and its mocker as replicas.

Dynamo routes only to workers registered with it. The peer ``dynamo_kv`` is therefore Dynamo's
frontend (``python -m dynamo.frontend --router-mode kv``: HTTP, tokenizer, KV router) plus one
relay worker per replica of the fleet (``bench/dynamo_worker.py``, run by Dynamo's own worker
runtime): the worker forwards each request to its replica's OpenAI API and has Dynamo's
``KvEventPublisher`` subscribe to the replica's ZMQ KV events, as Dynamo's own vLLM worker
does, so Dynamo's index sees the replica's cache. The frontend tokenizes with a Hugging Face
model directory built from the fleet's tokenizer (``model_dir``): the replicas' token ids.

Everything runs without etcd or NATS: file discovery (``DYN_FILE_KV``, a folder per run),
the TCP request plane and the ZMQ event plane, every host variable on 127.0.0.1. The event
plane still binds 0.0.0.0, so a run that starts Dynamo runs in a private network namespace
(bench/netns.py); ``start_dynamo_router`` refuses to start anywhere else.

Install (once, into ``.engines/dynamo``): ai-dynamo-runtime with its dependencies pinned by
bench/constraints-dynamo.txt, then ai-dynamo with ``--no-deps`` (it declares a stub,
``aisimulate``, that does not install).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvgate.backends.process import LOOPBACK, wait_until
from kvgate.bench.fleet import (
    BenchFleet,
    ManagedProcess,
    bench_port_range,
    tree_cpu_seconds,
    wait_own_http,
)
from kvgate.bench.netns import only_loopback
from kvgate.bench.peers import BENCH_DIR, PeerPackage, ensure_installed

DYNAMO = PeerPackage(
    "dynamo",
    (
        (
            "-c", str(BENCH_DIR / "constraints-dynamo.txt"), "ai-dynamo-runtime==1.6.1",
            "aiohttp", "certifi", "msgspec", "prometheus-client", "pyzmq", "tqdm",
            "transformers", "typing-extensions", "zstandard",
        ),
        ("--no-deps", "ai-dynamo==1.6.1"),
    ),
    "dynamo.frontend",
)  # fmt: skip
WORKER_SCRIPT = BENCH_DIR / "dynamo_worker.py"
NAMESPACE = "kvbench"
"""The Dynamo namespace of the router's relay workers (its frontend discovers only these)."""


class DynamoError(RuntimeError):
    """Dynamo could not be started here (or would have listened off loopback)."""


@dataclass(frozen=True, slots=True)
class DynamoRouterSpec:
    label: str
    router_mode: str
    frontend_args: tuple[str, ...] = ()


DYNAMO_ROUTERS: dict[str, DynamoRouterSpec] = {
    "dynamo_kv": DynamoRouterSpec("dynamo kv", "kv"),
}


def dynamo_env(store: Path) -> dict[str, str]:
    """Environment of every Dynamo process of one run: file discovery in ``store``, the TCP
    request plane and the ZMQ event plane, each host on loopback, no hub downloads."""
    return {
        "DYN_FILE_KV": str(store),
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": LOOPBACK,
        "DYN_EVENT_PLANE_HOST": LOOPBACK,
        "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK,
        "DYN_SYSTEM_HOST": LOOPBACK,
        "DYN_HTTP_HOST": LOOPBACK,
        "DYN_LOG": os.environ.get("DYN_LOG", "warn"),  # Dynamo's log level, warn unless set
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


_PLANES = ("--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq")


def frontend_argv(
    bin_dir: Path, port: int, namespace: str, router_mode: str, extra: Sequence[str] = ()
) -> list[str]:
    """Dynamo's OpenAI frontend on ``LOOPBACK:port``, routing to ``namespace``'s workers."""
    return [
        str(bin_dir / "python"), "-m", "dynamo.frontend",
        "--http-host", LOOPBACK, "--http-port", str(port),
        "--router-mode", router_mode, "--namespace", namespace, *_PLANES, *extra,
    ]  # fmt: skip


def worker_argv(
    bin_dir: Path,
    *,
    replica_url: str,
    events: str,
    topic: str,
    model_dir: Path,
    model: str,
    block_size: int,
    namespace: str = NAMESPACE,
    token_ids: bool = False,
) -> list[str]:
    """One relay worker (``-P``: the script's folder, bench/, is not put on ``sys.path``,
    where its modules would shadow packages Dynamo imports)."""
    return [
        str(bin_dir / "python"), "-P", str(WORKER_SCRIPT),
        "--replica", replica_url, "--events", events, f"--topic={topic}",
        "--model-dir", str(model_dir), "--model", model,
        "--block-size", str(block_size), "--namespace", namespace,
        *(["--return-token-ids"] if token_ids else []),
    ]  # fmt: skip


# --- the model directory the frontend loads -----------------------------------------------

_TOKEN_FLAGS = {"lstrip": False, "rstrip": False, "single_word": False, "normalized": False}


def _tokenizer_config(source: Mapping[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json`` with every added token's flags spelled out (Dynamo's
    parser requires ``lstrip``, ``rstrip`` and ``single_word``; the values are the defaults
    Hugging Face assumes when they are absent, so the tokenization does not change)."""
    config = dict(source)
    added = config.get("added_tokens_decoder")
    if isinstance(added, dict):
        config["added_tokens_decoder"] = {
            key: {**_TOKEN_FLAGS, **value} if isinstance(value, dict) else value
            for key, value in added.items()
        }
    return config


def _model_config(tokenizer: Mapping[str, Any], tok_config: Mapping[str, Any]) -> dict[str, Any]:
    """A minimal ``config.json`` for a tokenizer directory that has none (the simulator's):
    Dynamo reads the vocabulary size, the context length and the special tokens from it."""
    vocab = tokenizer.get("model", {}).get("vocab", {})
    added = tokenizer.get("added_tokens", [])
    ids = {t.get("content"): t.get("id") for t in added if isinstance(t, dict)}
    size = max([len(vocab), *(i + 1 for i in ids.values() if isinstance(i, int))])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": size,
        "max_position_embeddings": int(tok_config.get("model_max_length", 131072)),
        "bos_token_id": ids.get(tok_config.get("bos_token")),
        "eos_token_id": ids.get(tok_config.get("eos_token")),
    }


def model_dir(tokenizer_dir: Path, out: Path) -> Path:
    """A model directory for Dynamo at ``out`` with the tokenizer of ``tokenizer_dir`` (its
    ``tokenizer.json`` copied as is: the same token ids), its ``config.json`` (or a minimal
    one) and its ``tokenizer_config.json`` with the flags Dynamo needs."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tok_config)))
    if (tokenizer_dir / "config.json").is_file():
        shutil.copyfile(tokenizer_dir / "config.json", out / "config.json")
    else:
        tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
        (out / "config.json").write_text(json.dumps(_model_config(tokenizer, tok_config)))
    for extra in ("generation_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / extra).is_file():
            shutil.copyfile(tokenizer_dir / extra, out / extra)
    return out


# --- what Dynamo's index did with the events -------------------------------------------

APPLIED = "dynamo_component_kv_cache_events_applied"
"""The frontend's counter of KV events its index applied, by event type and status (``ok``,
``parent_block_not_found``: a stored chain whose parent it does not hold, skipped, ...)."""
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def index_counts(metrics: str) -> dict[str, float]:
    """``dynamo_<event type>_<status>`` -> events, summed over workers, from the frontend's
    ``/metrics`` text (at most the first 100,000 lines are read)."""
    out: dict[str, float] = {}
    for line in metrics.splitlines()[:100_000]:
        if not line.startswith(APPLIED + "{"):
            continue
        labels = dict(_LABEL.findall(line[len(APPLIED) : line.rfind("}") + 1]))
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (ValueError, IndexError):
            continue
        key = f"dynamo_{labels.get('event_type', '?')}_{labels.get('status', '?')}"
        out[key] = out.get(key, 0.0) + value
    return out


def scrape_index_counts(url: str) -> dict[str, float]:
    """``index_counts`` of the frontend at ``url`` ({} when it does not answer)."""
    try:
        resp = httpx.get(f"{url}/metrics", timeout=5.0)
    except httpx.HTTPError:
        return {}
    return index_counts(resp.text) if resp.status_code == 200 else {}


# --- processes ----------------------------------------------------------------------------


def require_private_netns() -> None:
    if not only_loopback():
        raise DynamoError(
            "Dynamo's event plane binds 0.0.0.0: it runs only in a private network namespace "
            "(kvgate bench re-executes itself in one when a run needs Dynamo; bench/netns.py)"
        )


class ProcessSet:
    """Processes started together (a Dynamo frontend and its workers), stopped together."""

    def __init__(self) -> None:
        self.processes: list[ManagedProcess] = []

    def add(self, proc: ManagedProcess) -> ManagedProcess:
        self.processes.append(proc.start())
        return proc

    def cpu_seconds(self) -> float:
        return sum(tree_cpu_seconds(p.pid) for p in self.processes if p.alive())

    def stop(self) -> None:
        for proc in self.processes:
            proc.terminate()
        for proc in reversed(self.processes):
            proc.stop()


def serving_workers(health: Any, namespace: str) -> int:
    """How many workers of ``namespace`` serve ``generate``, from the frontend's ``/health``
    answer (``{"instances": [{"namespace", "endpoint", ...}, ...]}``)."""
    instances = health.get("instances") if isinstance(health, dict) else None
    if not isinstance(instances, list):
        return 0
    return sum(
        1
        for i in instances[:4096]
        if isinstance(i, dict)
        and i.get("namespace") == namespace
        and i.get("endpoint") == "generate"
    )


def wait_serving(
    url: str,
    model: str,
    workers: int,
    timeout_s: float,
    watch: Sequence[ManagedProcess],
    namespace: str = NAMESPACE,
) -> None:
    """Until the frontend at ``url`` lists ``workers`` workers and a one-token completion
    through it answers 200 (Dynamo lists a model before it can serve it: the model's card is
    loaded after its first worker registers)."""
    body = {"model": model, "prompt": "ready", "max_tokens": 1, "temperature": 0.0}

    def serves() -> bool:
        try:
            health = client.get(f"{url}/health")
            if health.status_code != 200 or serving_workers(health.json(), namespace) < workers:
                return False
            resp = client.post(f"{url}/v1/completions", json=body)
        except (httpx.HTTPError, ValueError):
            return False
        return resp.status_code == 200

    what = f"Dynamo at {url} serving {model} with {workers} workers"
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        wait_until(serves, timeout_s, what, poll_s=0.5, watch=watch)


def start_dynamo_router(
    spec: DynamoRouterSpec, fleet: BenchFleet, log_dir: Path, timeout_s: float = 180.0
) -> tuple[ProcessSet, str]:
    """Dynamo's frontend and a relay worker per replica of ``fleet``; serving when returned."""
    require_private_netns()
    bin_dir = ensure_installed(DYNAMO, log_dir)
    env = dynamo_env(log_dir / "dynamo-store")
    models = model_dir(fleet.tokenizer, log_dir / "dynamo-model")
    port = bench_port_range(1, start=19500)
    procs = ProcessSet()
    try:
        front = procs.add(
            ManagedProcess(
                "dynamo-frontend",
                frontend_argv(bin_dir, port, NAMESPACE, spec.router_mode, spec.frontend_args),
                log_dir / "dynamo-frontend.log",
                env=env,
            )
        )
        for i, (url, events) in enumerate(zip(fleet.urls, fleet.event_endpoints, strict=True)):
            argv = worker_argv(
                bin_dir, replica_url=url, events=events, topic=fleet.topic, model_dir=models,
                model=fleet.model, block_size=fleet.block_size, token_ids=fleet.engine == "vllm",
            )  # fmt: skip
            name = f"dynamo-worker-{i}"
            procs.add(ManagedProcess(name, argv, log_dir / f"{name}.log", env=env))
        url = f"http://{LOOPBACK}:{port}"
        wait_own_http(f"{url}/health", timeout_s, front)
        wait_serving(url, fleet.model, len(fleet.urls), timeout_s, procs.processes)
    except (TimeoutError, RuntimeError, OSError):
        procs.stop()
        raise
    return procs, url
