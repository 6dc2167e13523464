"""Real SGLang CPU replicas for local trials and integration tests.

``kvgate engines --engine sglang install | model | up | down`` (see ``cli.py``): a pinned
SGLang 0.5.23 in its own venv under ``.engines/`` with a pure-torch stand-in for its kernel
package, the tiny random-weight model the vLLM set-up builds, and N replicas on 127.0.0.1 with
the radix prefix cache, cache reports, metrics and ZMQ KV events (bound on loopback).
"""
