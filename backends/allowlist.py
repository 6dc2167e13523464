"""Which hosts a worker added at run time may live on (``--worker-allow``).

A rule is a CIDR (``10.0.0.0/8``, ``fd00::/8``, or a bare address) or a host-name pattern
(``*.svc.cluster.local``, ``vllm-0.llm``; shell-style ``*`` and ``?``, case-insensitive;
``*`` alone admits every host). A host is allowed when it is

* an IP address inside a CIDR rule, or matching a pattern;
* a name matching a pattern;
* a name that resolves, every address of it, inside the CIDR rules.

With no rules, the default admits loopback, the hosts of the workers configured at start-up
and the hosts discovery currently reports (``add_known_hosts``).

The check is made when a worker is added. A name is resolved at that moment only: a name
that later resolves elsewhere (DNS rebinding) is not checked again, so rules for networks you
do not control should be addresses, not names.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from fnmatch import fnmatchcase
from urllib.parse import urlsplit

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Rule = Network | str
Resolver = Callable[[str], Awaitable[list[str]]]
"""Every address of a host name; raises ``OSError`` when it does not resolve."""

LOOPBACK: tuple[Network, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)
_PATTERN = re.compile(r"[a-z0-9*?_-]+(\.[a-z0-9*?_-]+)*\.?")
_RESOLVE_TIMEOUT_S = 2.0


def _address(text: str) -> Address | None:
    try:
        return ipaddress.ip_address(text.strip("[]").partition("%")[0])
    except ValueError:
        return None


def parse_allow_rule(text: str) -> Rule:
    """A ``--worker-allow`` rule: a network or a lower-case host pattern (``ValueError``)."""
    rule = text.strip().lower()
    if not rule:
        raise ValueError("a --worker-allow rule is empty")
    if "/" in rule or _address(rule) is not None:
        try:
            return ipaddress.ip_network(rule.strip("[]"), strict=False)
        except ValueError as exc:
            raise ValueError(f"--worker-allow {text!r} is not a CIDR: {exc}") from None
    if not _PATTERN.fullmatch(rule):
        raise ValueError(
            f"--worker-allow {text!r}: expected a CIDR such as 10.0.0.0/8 or a host pattern "
            "such as *.svc.cluster.local"
        )
    return rule


def host_of_url(url: str) -> str:
    """The host of an http(s) URL, lower-case, without brackets."""
    return (urlsplit(url).hostname or "").lower()


def host_of_endpoint(endpoint: str) -> str:
    """The host of a ``tcp://HOST:PORT`` ZMQ endpoint (``ValueError`` for anything else)."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    host = host.strip("[]").lower()
    if scheme != "tcp" or not sep or not colon or not port.isdigit() or not host or host == "*":
        raise ValueError("expected a tcp://HOST:PORT endpoint")
    return host


async def resolve_host(host: str) -> list[str]:
    """Every address of ``host``, from the loop's resolver (an executor thread)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class WorkerAllowlist:
    """The hosts run-time workers and their event endpoints may be on."""

    def __init__(
        self,
        rules: Sequence[str] = (),
        *,
        static_hosts: Iterable[str] = (),
        resolver: Resolver = resolve_host,
    ) -> None:
        parsed = [parse_allow_rule(rule) for rule in rules]
        self.default = not parsed
        if self.default:
            parsed = [*LOOPBACK, *(parse_allow_rule(host) for host in static_hosts if host)]
        self._networks = [rule for rule in parsed if not isinstance(rule, str)]
        self._patterns = [rule for rule in parsed if isinstance(rule, str)]
        self._known: list[Callable[[], Iterable[str]]] = []
        self._resolve = resolver

    def add_known_hosts(self, hosts: Callable[[], Iterable[str]]) -> None:
        """With the default rules, also admit the hosts ``hosts()`` lists at check time
        (discovered workers); explicit rules are left as given."""
        if self.default:
            self._known.append(hosts)

    def describe(self) -> str:
        """The rules in force, for messages."""
        rules = [str(n) for n in self._networks] + self._patterns
        extra = " plus discovered hosts" if self._known else ""
        return ", ".join(rules) + extra

    async def permits_host(self, host: str) -> bool:
        host = host.strip("[]").lower()
        address = _address(host)
        if address is not None:
            return self._address_allowed(address) or self._name_allowed(host)
        if self._name_allowed(host):
            return True
        if not self._networks:
            return False
        try:
            async with asyncio.timeout(_RESOLVE_TIMEOUT_S):
                found = await self._resolve(host)
        except (OSError, TimeoutError, UnicodeError):
            return False
        addresses = [a for a in (_address(text) for text in found) if a is not None]
        return bool(addresses) and all(self._address_allowed(a) for a in addresses)

    async def permits_endpoint(self, endpoint: str) -> bool:
        """A ``tcp://HOST:PORT`` ZMQ endpoint on an allowed host (anything else is refused):
        the check of event endpoints a worker declares itself (vLLM's /kv_event_sources)."""
        try:
            host = host_of_endpoint(endpoint)
        except ValueError:
            return False
        return await self.permits_host(host)

    def _address_allowed(self, address: Address) -> bool:
        if any(address in network for network in self._networks):
            return True
        return any(_address(known) == address for hosts in self._known for known in hosts())

    def _name_allowed(self, host: str) -> bool:
        if any(fnmatchcase(host, pattern) for pattern in self._patterns):
            return True
        return any(known.lower() == host for hosts in self._known for known in hosts())
