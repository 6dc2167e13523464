"""Where kvgate's commands keep their working folders: a checkout's own (``.engines``,
``bench/results``) when run from one, ``KVGATE_ENGINES_DIR`` or ``--dir`` when given, else
the user's cache (tests/test_wheel.py checks the installed side)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.backends import workdirs
from kvgate.backends.sglang_cpu.layout import SglangLayout
from kvgate.backends.vllm_cpu.layout import ENGINES_DIR_ENV, EngineLayout
from kvgate.bench.results import results_dir

ROOT = Path(__file__).resolve().parent.parent


def test_a_checkout_keeps_its_own_folders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINES_DIR_ENV, raising=False)
    assert workdirs.checkout_root() == ROOT
    assert EngineLayout.default().root == ROOT / ".engines"
    assert SglangLayout.default().root == ROOT / ".engines"
    assert results_dir() == ROOT / "bench" / "results"


def test_the_environment_and_dir_override_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(ENGINES_DIR_ENV, str(tmp_path / "shared"))
    assert EngineLayout.default().root == tmp_path / "shared"
    given = tmp_path / "given"
    assert EngineLayout.default(given).root == given  # --dir wins over the environment
    assert SglangLayout.default(given).root == given


def test_the_user_cache_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert workdirs.user_cache_dir() == tmp_path / "xdg" / "kvgate"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored (XDG spec)
    assert workdirs.user_cache_dir() == tmp_path / "home" / ".cache" / "kvgate"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert workdirs.user_cache_dir() == tmp_path / "home" / ".cache" / "kvgate"
