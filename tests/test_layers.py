"""Layers only point down: ``index`` < {``scoring``, ``backends``} < ``scheduling`` < ``router``
< ``bench``; ``scoring`` and ``backends`` are side by side (neither imports the other).

Every import in the product packages is read with ``ast`` (module level and inside functions,
``import x``, ``from x import y``, relative imports, ``importlib.import_module("x")`` with a
literal name) and resolved to the package it lands in. A package may import itself and the
packages below it; any other product package, any import cycle between packages, and any
product import of test code fail. ``tests/`` may import anything.

``scoring`` (pure pricing) and ``scheduling`` (the decision core) do no I/O: no network,
process, file or server library, no ``open``; ``scheduling`` uses ``asyncio`` only for the
queue's futures and timers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BELOW: Mapping[str, frozenset[str]] = {
    "index": frozenset(),
    "scoring": frozenset({"index"}),
    "backends": frozenset({"index"}),
    "scheduling": frozenset({"index", "scoring", "backends"}),
    "router": frozenset({"index", "scoring", "backends", "scheduling"}),
    "bench": frozenset({"index", "scoring", "backends", "scheduling", "router"}),
}
"""Each product package and the packages it may import (besides itself)."""
LAYERS = tuple(BELOW)
PURE = ("scoring", "scheduling")
"""Packages that do no I/O."""
IO_MODULES = frozenset(
    {
        "socket", "ssl", "selectors", "subprocess", "multiprocessing", "threading",
        "concurrent", "pathlib", "shutil", "tempfile", "io", "urllib", "http", "email",
        "httpx", "zmq", "uvicorn", "uvloop", "starlette", "fastapi", "prometheus_client",
        "opentelemetry", "msgpack", "yaml",
    }
)  # fmt: skip
"""Top-level modules a pure package may not import."""
ASYNCIO_PRIMITIVES = frozenset(
    {
        "AbstractEventLoop", "Future", "TimerHandle", "CancelledError", "FIRST_COMPLETED",
        "get_running_loop", "ensure_future", "wait",
    }
)  # fmt: skip
"""What of ``asyncio`` scheduling may use: futures and timers for the queue's waiters."""
TEST_PACKAGES = frozenset(
    {"tests", "conftest", "fakes"}
    | {path.stem for path in (ROOT / "tests").glob("*.py")}
    | {path.name for path in (ROOT / "tests").iterdir() if (path / "__init__.py").is_file()}
)


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement: who imports what, and where."""

    source: str  # the importing module, e.g. "backends.registry"
    target: str  # the absolute module imported, e.g. "router.config"
    where: str  # "backends/registry.py:26"

    @property
    def source_package(self) -> str:
        return package_of(self.source)

    @property
    def target_package(self) -> str:
        return package_of(self.target)


def package_of(module: str) -> str:
    """The product package a module lands in: ``kvgate.router.app`` and ``router.app`` are
    both in ``router`` (the folders are installed under ``kvgate``)."""
    parts = module.split(".")
    if parts[0] == "kvgate" and len(parts) > 1:
        return parts[1]
    return parts[0]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from {'.' * level}{name} import ...`` inside ``module``."""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    if level - 1 > len(base) - 1:
        raise ValueError(f"relative import beyond the top level in {module}")
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def imports_of(source: str, module: str, is_package: bool, filename: str) -> Iterator[Import]:
    """Every import ``source`` (the text of ``module``) makes, wherever it sits in the tree."""
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, where)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(module, is_package, node.level, node.module)
            else:
                base = node.module or ""
            yield Import(module, base, where)
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield Import(module, first.value, where)


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in {"__import__", "import_module"}
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def product_imports(root: Path = ROOT) -> list[Import]:
    found: list[Import] = []
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            module = module_name(path, root)
            filename = str(path.relative_to(root))
            text = path.read_text(encoding="utf-8")
            found += imports_of(text, module, path.name == "__init__.py", filename)
    return found


def upward(imports: list[Import]) -> list[str]:
    """Imports of a package not below the importer (or of test code, from the product)."""
    problems = []
    for imp in imports:
        source, target = imp.source_package, imp.target_package
        if target in TEST_PACKAGES:
            problems.append(f"{imp.where}: {imp.source} imports test code {imp.target}")
        elif target in BELOW and target != source and target not in BELOW[source]:
            problems.append(
                f"{imp.where}: {imp.source} ({source}) imports {imp.target} (not below it)"
            )
    return problems


def package_cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected groups of more than one package in the import graph (Tarjan)."""
    graph: dict[str, set[str]] = {package: set() for package in LAYERS}
    for imp in imports:
        if imp.target_package in BELOW and imp.target_package != imp.source_package:
            graph[imp.source_package].add(imp.target_package)
    return [sorted(group) for group in _components(graph) if len(group) > 1]


def io_uses(source: str, package: str, filename: str) -> list[str]:
    """What ``source`` (a module of ``package``) does that is I/O: an import of an I/O
    module, a call of ``open``, ``asyncio`` beyond the queue's primitives (``scheduling``)
    or at all (any other package)."""
    problems = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
            if node.module == "asyncio":
                names += [f"asyncio.{alias.name}" for alias in node.names]
        elif _calls(node, "open"):
            problems.append(f"{where}: open()")
        elif _attribute_of(node, "asyncio"):
            assert isinstance(node, ast.Attribute)
            names = [f"asyncio.{node.attr}"]
        for name in names:
            top, _, attr = name.partition(".")
            if top in IO_MODULES:
                problems.append(f"{where}: imports {name}")
            elif top == "asyncio" and (
                package != "scheduling" or (attr and attr not in ASYNCIO_PRIMITIVES)
            ):
                problems.append(f"{where}: uses {name}")
    return problems


def _calls(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def _attribute_of(node: ast.AST, module: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == module
    )


def pure_package_io(root: Path = ROOT) -> list[str]:
    problems: list[str] = []
    for package in PURE:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            problems += io_uses(text, package, str(path.relative_to(root)))
    return problems


def _components(graph: Mapping[str, set[str]]) -> list[list[str]]:
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            groups.append(group)

    for node in graph:
        if node not in order:
            visit(node)
    return groups


# -- the tree ------------------------------------------------------------------------------


def test_every_product_module_is_read() -> None:
    imports = product_imports()
    importers = {imp.source_package for imp in imports}
    assert importers == set(LAYERS), importers
    assert len(imports) > 200  # a walker that found nothing would pass everything


def test_no_package_imports_one_above_it() -> None:
    problems = upward(product_imports())
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_no_import_cycle_between_packages() -> None:
    cycles = package_cycles(product_imports())
    assert not cycles, f"import cycles between packages: {cycles}"


def bare_imports(source: str, filename: str) -> list[str]:
    """Absolute imports of a product package by its bare name (``router.app``): installed,
    the packages are ``kvgate.router``, ``kvgate.index``, ...; a bare name would import
    whatever else is installed under it, or nothing."""
    problems = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names = [first.value]
        problems += [
            f"{filename}:{getattr(node, 'lineno', 0)}: {name}"
            for name in names
            if name.split(".")[0] in BELOW
        ]
    return problems


def test_product_code_imports_its_packages_under_kvgate() -> None:
    problems: list[str] = []
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            problems += bare_imports(text, str(path.relative_to(ROOT)))
    assert not problems, "bare product imports:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ("from router.config import Settings", True),
        ("import index.types", True),
        ("importlib.import_module('bench.fleet')", True),
        ("from kvgate.router.config import Settings", False),
        ("from .config import Settings", False),
        ("import json", False),
    ],
)
def test_a_bare_product_import_is_caught(source: str, bad: bool) -> None:
    assert bool(bare_imports(source, "x.py")) is bad


def test_scoring_and_scheduling_do_no_io() -> None:
    problems = pure_package_io()
    assert not problems, "I/O in a pure package:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("package", "source", "bad"),
    [
        ("scoring", "import socket", True),
        ("scoring", "from httpx import AsyncClient", True),
        ("scheduling", "import zmq.asyncio", True),
        ("scoring", "import asyncio", True),
        ("scheduling", "import asyncio\nf = asyncio.get_running_loop().create_future()", False),
        ("scheduling", "import asyncio\nasyncio.open_connection('h', 1)", True),
        ("scheduling", "from asyncio import sleep", True),
        ("scheduling", "data = open('f').read()", True),
        ("scoring", "import math, xxhash", False),
    ],
)
def test_io_in_a_pure_package_is_caught(package: str, source: str, bad: bool) -> None:
    assert bool(io_uses(source, package, "crafted.py")) is bad


# -- the walker, on crafted sources --------------------------------------------------------

CRAFTED = """
import index.types
import scoring.api as api, json
from backends import registry
from .config import X
from .. import errors
from ..sim.events import Y


def late() -> None:
    from router.errors import KvgateError


class K:
    def method(self) -> None:
        import bench.fleet


importlib.import_module("router.serve")
"""


def test_the_walker_finds_every_form_of_import() -> None:
    found = {
        imp.target for imp in imports_of(CRAFTED, "backends.vllm_cpu.launch", False, "crafted.py")
    }
    assert found == {
        "index.types",
        "scoring.api",
        "json",
        "backends",
        "backends.vllm_cpu.config",
        "backends.sim.events",
        "router.errors",
        "bench.fleet",
        "router.serve",
    }


def test_relative_imports_in_a_package_init_resolve_from_the_package() -> None:
    source = "from .keys import K\nfrom .. import api\n"
    found = {imp.target for imp in imports_of(source, "index.keys", True, "x.py")}
    assert found == {"index.keys.keys", "index"}


@pytest.mark.parametrize(
    ("module", "source", "bad"),
    [
        ("backends.registry", "from router.config import WorkerConfig", True),
        ("backends.registry", "from scoring.api import Candidate", True),  # side by side
        ("scoring.cost", "from backends.registry import Worker", True),
        ("scoring.cost", "from scheduling.capacity import Parts", True),
        ("scheduling.ledger", "from backends.registry import Worker", False),
        ("scheduling.queue", "from router.errors import QueueFull", True),
        ("router.gateway", "from scheduling.scheduler import Scheduler", False),
        ("backends.registry", "def f():\n    import router.errors", True),
        ("scoring.cost", "from index.types import BlockKey", False),
        ("index.x", "from scoring import api", True),
        ("router.app", "from bench import fleet", True),
        ("bench.fleet", "from router.config import Settings", False),
        ("router.app", "from fakes.server import serve", True),
        ("router.app", "from .errors import KvgateError", False),
    ],
)
def test_upward_and_test_imports_are_caught(module: str, source: str, bad: bool) -> None:
    imports = list(imports_of(source, module, False, "crafted.py"))
    assert bool(upward(imports)) is bad


def test_a_cycle_between_packages_is_caught() -> None:
    imports = [
        Import("router.app", "backends.registry", "a.py:1"),
        Import("backends.registry", "router.errors", "b.py:1"),
        Import("scoring.cost", "index.types", "c.py:1"),
    ]
    assert package_cycles(imports) == [["backends", "router"]]
    assert package_cycles(imports[::2]) == []
