"""Where the SGLang venv, its stamp, its logs and its detached fleet live (``.engines/``,
shared with the vLLM set-up: the same engines folder, tiny model and logs folder)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvgate.backends.vllm_cpu.layout import EngineLayout


@dataclass(frozen=True, slots=True)
class SglangLayout:
    """Paths of the SGLang set-up under one engines folder (git-ignored)."""

    root: Path

    @classmethod
    def default(cls, given: Path | None = None) -> SglangLayout:
        """The engines folder the vLLM set-up uses (``EngineLayout.default``)."""
        return cls(EngineLayout.default(given).root)

    @property
    def venv(self) -> Path:
        return self.root / "sglang-venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def install_stamp(self) -> Path:
        return self.venv / ".kvgate-installed.json"

    @property
    def model_dir(self) -> Path:
        return self.root / "tiny-model"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def install_log(self) -> Path:
        return self.logs / "sglang-install.log"

    @property
    def fleet_state(self) -> Path:
        """Process groups of replicas left running by ``up --detach``."""
        return self.root / "sglang-fleet.json"
