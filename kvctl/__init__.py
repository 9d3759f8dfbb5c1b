"""kvctl: see and steer the KV-cache memory of LLM inference on a node."""

__version__ = "0.1.0"
