"""Where the engines, their venv, the tiny model and the logs live (``.engines/``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvgate.backends.workdirs import work_dir

ENGINES_DIR_ENV = "KVGATE_ENGINES_DIR"
"""Environment variable naming the engines folder (the default: see ``EngineLayout.default``)."""
ENGINES_DIR_HELP = (
    "engines folder: venvs, tiny model, logs (default $KVGATE_ENGINES_DIR, else "
    "<checkout>/.engines in a checkout, else $XDG_CACHE_HOME/kvgate/engines)"
)


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """Paths under one engines folder (git-ignored)."""

    root: Path

    @classmethod
    def default(cls, given: Path | None = None) -> EngineLayout:
        """``given`` (``--dir``), else ``$KVGATE_ENGINES_DIR``, else ``<checkout>/.engines``
        when run from a checkout, else ``<user cache>/engines``."""
        if given is not None:
            return cls(given)
        override = os.environ.get(ENGINES_DIR_ENV)
        return cls(Path(override) if override else work_dir(".engines", "engines"))

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
