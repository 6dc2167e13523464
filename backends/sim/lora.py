"""LoRA adapters of one replica, served the way vLLM's OpenAI server does.

* Adapters are named models: a request whose ``model`` is an adapter's name is served with
  it; ``/v1/models`` lists each one with ``parent`` = the base model and ``root`` = its path.
* Each load takes the next integer id (from 1, in load order; vLLM's ``lora_int_id``); a
  reload in place (``load_inplace``) keeps it. That id is the ``lora_id`` of the adapter's
  KV events; the name is what keys its cache (vLLM puts the name in every block hash), so an
  adapter unloaded and loaded again finds its old blocks.
* The simulator has no weights: any non-empty path loads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvgate.backends.sim.config import LoraModule

MAX_ADAPTERS = 1024
"""Adapters one replica holds at most (a load past it is refused)."""


class LoraError(ValueError):
    """A refused load or unload: vLLM's status, error type and message."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


@dataclass(frozen=True, slots=True)
class Adapter:
    """A loaded adapter: its name, vLLM's integer id and the path it was loaded from."""

    name: str
    lora_id: int
    path: str


class AdapterRegistry:
    """The adapters a replica serves (vLLM's ``OpenAIServingModels``)."""

    def __init__(self, base_model: str, modules: Sequence[LoraModule] = ()) -> None:
        self._base = base_model
        self._adapters: dict[str, Adapter] = {}
        self._next_id = 1
        for module in modules:
            self.load(module.name, module.path)

    def __iter__(self) -> Iterator[Adapter]:
        return iter(list(self._adapters.values()))

    def __len__(self) -> int:
        return len(self._adapters)

    def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    def load(self, name: str, path: str, *, in_place: bool = False) -> Adapter:
        """Load (or, ``in_place``, reload keeping its id) the adapter ``name``."""
        if not name or not path:
            raise LoraError(
                400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."
            )
        old = self._adapters.get(name)
        if old is not None and not in_place:
            raise LoraError(
                400,
                "InvalidUserInput",
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
            )
        if name == self._base:
            raise LoraError(400, "BadRequestError", f"'{name}' is the base model's name")
        if old is None and len(self._adapters) >= MAX_ADAPTERS:
            raise LoraError(400, "BadRequestError", f"at most {MAX_ADAPTERS} adapters")
        if old is not None:
            adapter = Adapter(name, old.lora_id, path)
        else:
            adapter = Adapter(name, self._next_id, path)
            self._next_id += 1
        self._adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> Adapter:
        if not name:
            raise LoraError(
                400,
                "InvalidUserInput",
                "'lora_name' needs to be provided to unload a LoRA adapter.",
            )
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise LoraError(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
        return adapter
