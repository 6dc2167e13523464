"""kvgate: a cache-aware router for LLM serving.

The repository keeps its packages at the top (``router/``, ``index/``, ``scoring/``,
``scheduling/``, ``backends/``, ``bench/``); they are installed under this one name
(``kvgate.router``, ...), through the links in this folder, so that kvgate claims no
generic top-level module.
"""
