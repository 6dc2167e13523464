"""Where kvgate's commands keep their working folders (engines' venvs, models, logs, bench
results): a checkout's own folders when kvgate runs from a checkout (``<checkout>/.engines``,
``<checkout>/bench/results``), else the user's cache (``$XDG_CACHE_HOME/kvgate``, by default
``~/.cache/kvgate``). Never inside the installed package: site-packages may be read-only and
is replaced by every upgrade."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "XDG_CACHE_HOME"


def checkout_root() -> Path | None:
    """The kvgate checkout this code runs from (an editable install follows the ``kvgate/``
    links back to it), or None when it runs from an installed wheel."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "kvgate" / "__init__.py").is_file():
        return root
    return None


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kvgate`` (an absolute XDG_CACHE_HOME only, as the XDG spec says),
    else ``~/.cache/kvgate``."""
    xdg = os.environ.get(CACHE_ENV, "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "kvgate"


def work_dir(in_checkout: str, in_cache: str) -> Path:
    """``<checkout>/<in_checkout>`` when running from a checkout, else
    ``<user cache>/<in_cache>``."""
    root = checkout_root()
    return root / in_checkout if root is not None else user_cache_dir() / in_cache
