"""A simulated vLLM-like engine fleet speaking the real HTTP and KV-event protocols."""
