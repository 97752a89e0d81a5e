"""A replay of vLLM's engine loop for the kvtier adapter (see engine.py)."""
