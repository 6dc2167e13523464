"""Engine adapters (vLLM, SGLang, OpenAI-compatible), health and load scraping, the simulator."""
