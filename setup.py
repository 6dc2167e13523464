"""The one compiled part of kvgate: the index layer's native core (index/csrc/ -> index._native).

Everything else is declared in pyproject.toml; setuptools reads both.
"""

from pathlib import Path

from setuptools import Extension, setup

NATIVE = Path("index/csrc")

setup(
    ext_modules=[
        Extension(
            "kvgate.index._native",
            sources=sorted(str(path) for path in NATIVE.glob("*.c")),
            depends=sorted(str(path) for path in NATIVE.glob("*.h")),
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit"],
        )
    ]
)
