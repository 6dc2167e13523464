"""Where the engines, their venv, the tiny model and the logs live (``.engines/``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ENGINES_DIR_ENV = "KVGATE_ENGINES_DIR"
"""Environment variable overriding the default ``<repo>/.engines`` folder."""


def repo_root() -> Path:
    """The kvgate checkout this package lives in."""
    return Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """Paths under one engines folder (git-ignored)."""

    root: Path

    @classmethod
    def default(cls) -> EngineLayout:
        override = os.environ.get(ENGINES_DIR_ENV)
        return cls(Path(override) if override else repo_root() / ".engines")

    @property
    def venv(self) -> Path:
        return self.root / "vllm-venv"

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
    def fleet_state(self) -> Path:
        """Process groups of replicas left running by ``kvgate engines up --detach``."""
        return self.root / "fleet.json"
