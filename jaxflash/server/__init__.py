"""The OpenAI- and Anthropic-compatible HTTP server (scripts/serve.py).

    api.py       endpoints, validation, streaming formats, errors
    worker.py    the engine thread: continuous batching, cancellation
    parsing.py   tokens -> text, <think> reasoning, tool calls, stop strings (incremental)
    grammar.py   response_format JSON constraints (llguidance token masks)
    metrics.py   Prometheus metrics
    protocol.py  request models and error objects
    net.py       uvicorn settings (header read timeout)
"""

from .api import create_app
from .net import uvicorn_config

__all__ = ["create_app", "uvicorn_config"]
