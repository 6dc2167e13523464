"""Where benchmark results go by default: ``<checkout>/bench/results`` in a checkout
(git-ignored), else ``$XDG_CACHE_HOME/kvgate/bench-results`` (``~/.cache/kvgate/...``);
every command takes ``--out`` (or ``--log-dir``) to put them elsewhere."""

from __future__ import annotations

from pathlib import Path

from kvgate.backends.workdirs import work_dir


def results_dir() -> Path:
    return work_dir("bench/results", "bench-results")
