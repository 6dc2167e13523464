"""DNS discovery: URL parsing, reconciliation, failure handling, metrics, real resolution."""

from __future__ import annotations

import asyncio
import socket

import pytest
from fakes.wait import wait_until
from prometheus_client import CollectorRegistry

from kvgate.backends.config import WorkerConfig
from kvgate.backends.discovery import (
    DiscoveredWorker,
    DiscoveryMetrics,
    DnsDiscovery,
    DnsDiscoveryConfig,
    loop_resolver,
    parse_discovery_url,
    worker_for_address,
)
from kvgate.backends.errors import DiscoveryUrlError

TARGET = "vllm.ns.svc.cluster.local:8000"


# --- URL parsing ------------------------------------------------------------------------


def test_parse_defaults() -> None:
    config = parse_discovery_url("dns://vllm.ns.svc.cluster.local:8000")
    assert config == DnsDiscoveryConfig(host="vllm.ns.svc.cluster.local", port=8000)
    assert (config.events_port, config.replay_port, config.engine) == (5557, 5558, "vllm")
    assert config.target == TARGET


def test_parse_every_option() -> None:
    config = parse_discovery_url(
        "dns://sgl.ns:30000?events_port=6000&replay_port=none&engine=sglang&scheme=https"
        "&interval=0.5&timeout=1&family=ipv4&remove_after=3"
    )
    assert config == DnsDiscoveryConfig(
        host="sgl.ns",
        port=30000,
        scheme="https",
        engine="sglang",
        events_port=6000,
        replay_port=None,
        interval_s=0.5,
        timeout_s=1.0,
        family="ipv4",
        remove_after=3,
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://vllm:8000", "must start with dns://"),
        ("vllm:8000", "must start with dns://"),
        ("dns://vllm", "needs the engines' HTTP port"),
        ("dns://:8000", "has no host"),
        ("dns://vllm:99999", "invalid port"),
        ("dns://vllm:8000/v1", "no user, path or fragment"),
        ("dns://vllm:8000?evnts_port=1", "unknown option 'evnts_port'"),
        ("dns://vllm:8000?events_port=70000", "option events_port"),
        ("dns://vllm:8000?events_port=x", "is not an integer"),
        ("dns://vllm:8000?engine=tgi", "'tgi' is not one of vllm, sglang, trtllm, openai"),
        ("dns://vllm:8000?interval=0", "between 0.01 and 3600"),
        ("dns://vllm:8000?remove_after=0", "at least 1"),
        ("dns://vllm:8000?engine=vllm&engine=sglang", "given twice"),
        ("dns://vllm:8000?family=ipv5", "option family"),
    ],
)
def test_parse_errors_say_what_to_fix(url: str, message: str) -> None:
    with pytest.raises(DiscoveryUrlError, match=message):
        parse_discovery_url(url)


def test_auto_ports_leave_endpoints_to_the_engine() -> None:
    config = parse_discovery_url("dns://vllm:8000?events_port=auto&replay_port=auto")
    worker = worker_for_address(config, "10.0.0.1")
    assert (worker.events, worker.replay) == (None, None)  # vLLM: GET /kv_event_sources


def test_url_error_is_a_value_error() -> None:
    """pydantic validators turn ValueError into a field error: the gateway relies on it."""
    assert issubclass(DiscoveryUrlError, ValueError)


def test_worker_for_ipv4_and_ipv6() -> None:
    config = DnsDiscoveryConfig(host="h", port=8000)
    assert worker_for_address(config, "10.1.2.3") == DiscoveredWorker(
        url="http://10.1.2.3:8000",
        engine="vllm",
        events="tcp://10.1.2.3:5557",
        replay="tcp://10.1.2.3:5558",
        address="10.1.2.3",
    )
    v6 = worker_for_address(config, "fd00::7")
    assert (v6.url, v6.events) == ("http://[fd00::7]:8000", "tcp://[fd00::7]:5557")
    config_entry = WorkerConfig.model_validate(v6.worker_fields())
    assert (config_entry.url, config_entry.engine) == ("http://[fd00::7]:8000", "vllm")
    assert (config_entry.events, config_entry.replay) == (v6.events, v6.replay)
    no_events = DnsDiscoveryConfig(host="h", port=80, events_port=None, replay_port=None)
    assert worker_for_address(no_events, "10.0.0.1").events is None


# --- reconciliation with an injected resolver -------------------------------------------


class ScriptedDns:
    """A resolver whose answer the test sets; ``None`` makes it fail like a DNS outage."""

    def __init__(self, answer: list[str] | None) -> None:
        self.answer = answer
        self.calls = 0
        self.hang = asyncio.Event()
        self.hanging = False

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        if self.hanging:
            await self.hang.wait()
        if self.answer is None:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return list(self.answer)


class Fleet:
    """What the gateway would hold: workers by URL, and the order of callbacks."""

    def __init__(self) -> None:
        self.workers: dict[str, DiscoveredWorker] = {}
        self.log: list[tuple[str, str]] = []

    async def on_added(self, worker: DiscoveredWorker) -> None:
        self.workers[worker.url] = worker
        self.log.append(("added", worker.url))

    async def on_removed(self, url: str) -> None:
        del self.workers[url]
        self.log.append(("removed", url))


def make_discovery(
    dns: ScriptedDns,
    fleet: Fleet,
    registry: CollectorRegistry,
    **overrides: object,
) -> DnsDiscovery:
    fields: dict[str, object] = {"host": "vllm.ns.svc.cluster.local", "port": 8000}
    fields.update(overrides)
    config = DnsDiscoveryConfig(**fields)  # type: ignore[arg-type]
    return DnsDiscovery(
        config,
        on_added=fleet.on_added,
        on_removed=fleet.on_removed,
        metrics=DiscoveryMetrics(registry),
        resolver=dns,
        clock=lambda: 1234.0,
    )


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"target": TARGET, **labels})


@pytest.mark.anyio
async def test_adds_then_removes_after_consecutive_absences() -> None:
    dns, fleet, registry = (
        ScriptedDns(["10.0.0.2", "10.0.0.1", "10.0.0.1"]),
        Fleet(),
        CollectorRegistry(),
    )
    discovery = make_discovery(dns, fleet, registry, remove_after=2)

    first = await discovery.refresh()
    assert first.added == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    assert sorted(fleet.workers) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert fleet.workers["http://10.0.0.1:8000"].events == "tcp://10.0.0.1:5557"

    dns.answer = ["10.0.0.1", "10.0.0.3"]
    second = await discovery.refresh()
    assert second.added == ("http://10.0.0.3:8000",)
    assert second.removed == ()  # absent once: not yet removed
    assert "http://10.0.0.2:8000" in fleet.workers

    third = await discovery.refresh()
    assert third.removed == ("http://10.0.0.2:8000",)
    assert sorted(fleet.workers) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    assert [w.url for w in discovery.workers] == sorted(fleet.workers)

    assert sample(registry, "kvgate_discovery_workers") == 2
    assert sample(registry, "kvgate_discovery_changes_total", change="added") == 3
    assert sample(registry, "kvgate_discovery_changes_total", change="removed") == 1
    assert sample(registry, "kvgate_discovery_resolutions_total", result="ok") == 3
    assert sample(registry, "kvgate_discovery_last_success_timestamp_seconds") == 1234.0


@pytest.mark.anyio
async def test_address_back_before_threshold_is_not_removed() -> None:
    dns, fleet, registry = ScriptedDns(["10.0.0.1", "10.0.0.2"]), Fleet(), CollectorRegistry()
    discovery = make_discovery(dns, fleet, registry, remove_after=2)
    await discovery.refresh()
    dns.answer = ["10.0.0.1"]
    await discovery.refresh()
    dns.answer = ["10.0.0.1", "10.0.0.2"]
    await discovery.refresh()
    dns.answer = ["10.0.0.1"]
    assert (await discovery.refresh()).removed == ()  # the absence count restarted
    assert len(fleet.log) == 2


@pytest.mark.anyio
async def test_resolution_failure_keeps_last_known_set() -> None:
    dns, fleet, registry = ScriptedDns(["10.0.0.1", "10.0.0.2"]), Fleet(), CollectorRegistry()
    discovery = make_discovery(dns, fleet, registry, remove_after=1)
    await discovery.refresh()
    dns.answer = None
    for _ in range(3):
        result = await discovery.refresh()
        assert not result.ok
    assert len(fleet.workers) == 2
    assert fleet.log == [("added", "http://10.0.0.1:8000"), ("added", "http://10.0.0.2:8000")]
    assert sample(registry, "kvgate_discovery_resolutions_total", result="error") == 3
    assert sample(registry, "kvgate_discovery_workers") == 2


@pytest.mark.anyio
async def test_resolver_timeout_counts_as_failure() -> None:
    dns, fleet, registry = ScriptedDns(["10.0.0.1"]), Fleet(), CollectorRegistry()
    discovery = make_discovery(dns, fleet, registry, timeout_s=0.05)
    await discovery.refresh()
    dns.hanging = True
    assert not (await discovery.refresh()).ok
    assert len(fleet.workers) == 1
    assert sample(registry, "kvgate_discovery_resolutions_total", result="error") == 1


@pytest.mark.anyio
async def test_addresses_are_normalised_and_junk_ignored(caplog: pytest.LogCaptureFixture) -> None:
    dns = ScriptedDns(["::0001", "::1", "127.0.0.1", "not-an-ip", "fe80::1%eth0"])
    fleet = Fleet()
    discovery = make_discovery(dns, fleet, CollectorRegistry())
    await discovery.refresh()
    assert sorted(fleet.workers) == [
        "http://127.0.0.1:8000",
        "http://[::1]:8000",
        "http://[fe80::1%eth0]:8000",
    ]
    assert "not an IP address" in caplog.text


@pytest.mark.anyio
async def test_background_loop_follows_dns_and_stops() -> None:
    dns, fleet, registry = ScriptedDns(["10.0.0.1"]), Fleet(), CollectorRegistry()
    discovery = make_discovery(dns, fleet, registry, interval_s=0.01, remove_after=1)
    async with discovery:
        assert discovery.running
        assert list(fleet.workers) == ["http://10.0.0.1:8000"]  # known before start returns
        assert sample(registry, "kvgate_discovery_up") == 1
        dns.answer = ["10.0.0.9"]
        await wait_until(lambda: list(fleet.workers) == ["http://10.0.0.9:8000"])
        dns.answer = None
        calls = dns.calls
        await wait_until(lambda: dns.calls >= calls + 3)
        assert list(fleet.workers) == ["http://10.0.0.9:8000"]
    assert not discovery.running
    assert sample(registry, "kvgate_discovery_up") == 0


@pytest.mark.anyio
async def test_a_failing_callback_costs_its_change_not_the_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dns, registry = ScriptedDns(["10.0.0.1"]), CollectorRegistry()
    fleet = Fleet()
    failures = 0

    async def broken_add(worker: DiscoveredWorker) -> None:
        nonlocal failures
        if worker.address == "10.0.0.2" and failures < 3:
            failures += 1
            raise RecursionError("a worker's answer nobody foresaw")
        await fleet.on_added(worker)

    discovery = DnsDiscovery(
        DnsDiscoveryConfig(host="vllm.ns.svc.cluster.local", port=8000, interval_s=0.01),
        on_added=broken_add,
        on_removed=fleet.on_removed,
        metrics=DiscoveryMetrics(registry),
        resolver=dns,
    )
    await discovery.start()
    try:
        dns.answer = ["10.0.0.1", "10.0.0.2"]
        # each failed add is counted and tried again next round; the loop never stops
        await wait_until(lambda: "http://10.0.0.2:8000" in fleet.workers)
        assert discovery.running
        assert sample(registry, "kvgate_discovery_up") == 1
        assert sample(registry, "kvgate_discovery_failures_total", step="added") == 3
        assert "added worker http://10.0.0.2:8000 failed" in caplog.text
        assert [w.address for w in discovery.workers] == ["10.0.0.1", "10.0.0.2"]
    finally:
        await discovery.stop()


@pytest.mark.anyio
async def test_two_targets_share_one_metrics_object() -> None:
    registry = CollectorRegistry()
    metrics = DiscoveryMetrics(registry)
    fleet = Fleet()
    for host, address in (("a.ns", "10.0.0.1"), ("b.ns", "10.0.0.2")):
        discovery = DnsDiscovery(
            DnsDiscoveryConfig(host=host, port=8000),
            on_added=fleet.on_added,
            on_removed=fleet.on_removed,
            metrics=metrics,
            resolver=ScriptedDns([address]),
        )
        await discovery.refresh()
    assert registry.get_sample_value("kvgate_discovery_workers", {"target": "a.ns:8000"}) == 1
    assert registry.get_sample_value("kvgate_discovery_workers", {"target": "b.ns:8000"}) == 1


# --- the real resolver ------------------------------------------------------------------


@pytest.mark.anyio
async def test_real_resolver_on_localhost() -> None:
    addresses = set(await loop_resolver("any")("localhost", 8000))
    assert addresses & {"127.0.0.1", "::1"}
    assert addresses <= {"127.0.0.1", "::1"}
    assert set(await loop_resolver("ipv4")("localhost", 8000)) == {"127.0.0.1"}

    fleet, registry = Fleet(), CollectorRegistry()
    discovery = DnsDiscovery(
        parse_discovery_url("dns://localhost:8000?family=ipv4&events_port=7557"),
        on_added=fleet.on_added,
        on_removed=fleet.on_removed,
        metrics=DiscoveryMetrics(registry),
    )
    await discovery.refresh()
    assert list(fleet.workers) == ["http://127.0.0.1:8000"]
    assert fleet.workers["http://127.0.0.1:8000"].events == "tcp://127.0.0.1:7557"
