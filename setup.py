"""The one compiled part of kvgate: the index layer's native core (index/csrc/ -> index._native).

Everything else is declared in pyproject.toml; setuptools reads both.
"""

from setuptools import Extension, setup

NATIVE = "index/csrc"

setup(
    ext_modules=[
        Extension(
            "index._native",
            sources=[f"{NATIVE}/native.c"],
            depends=[f"{NATIVE}/maps.h", f"{NATIVE}/table.h", f"{NATIVE}/xxh3.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit"],
        )
    ]
)
