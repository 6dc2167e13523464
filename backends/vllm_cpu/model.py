"""Build (or reuse) the tiny random-weight model with the vLLM venv's python."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from kvgate.backends.vllm_cpu.install import run_logged

BUILDER_SCRIPT = Path(__file__).with_name("tiny_model_script.py")
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
STAMP_NAME = ".kvgate-model.json"
DEFAULT_SEED = 0
BUILD_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class ModelReport:
    path: Path
    reused: bool
    seconds: float


def _wanted_stamp(seed: int) -> dict[str, str | int]:
    digest = hashlib.sha256(BUILDER_SCRIPT.read_bytes()).hexdigest()
    return {"builder_sha256": digest, "seed": seed}


def is_built(out: Path, seed: int = DEFAULT_SEED) -> bool:
    """True when every model file is there and was made by this builder with this seed."""
    stamp = out / STAMP_NAME
    if not all((out / name).is_file() for name in MODEL_FILES) or not stamp.is_file():
        return False
    try:
        return bool(json.loads(stamp.read_text()) == _wanted_stamp(seed))
    except (OSError, ValueError):
        return False


def ensure_model(
    python: Path, out: Path, log_path: Path, *, seed: int = DEFAULT_SEED, force: bool = False
) -> ModelReport:
    """Run the builder script in ``python`` (the vLLM venv) unless ``out`` is up to date."""
    if not force and is_built(out, seed):
        return ModelReport(out, reused=True, seconds=0.0)
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(python), str(BUILDER_SCRIPT), "--out", str(out), "--seed", str(seed)]
    run_logged("model build", cmd, log_path, timeout_s=BUILD_TIMEOUT_S, append=False)
    (out / STAMP_NAME).write_text(json.dumps(_wanted_stamp(seed)))
    return ModelReport(out, reused=False, seconds=time.monotonic() - started)
