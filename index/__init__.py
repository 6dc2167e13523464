"""Prompt → KV-block keys, the global block index, and KV-event ingestion."""
