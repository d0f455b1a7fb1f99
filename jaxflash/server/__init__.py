"""The OpenAI- and Anthropic-compatible HTTP server (scripts/serve.py).

    api.py       endpoints, validation, streaming formats, errors, key and body guard
    worker.py    the engine thread: continuous batching, cancellation, gauges
    prompt.py    chat rendering and tokenising (control tokens in user content kept as text, prefill)
    parsing.py   tokens -> text, <think> reasoning, tool calls, stop strings (incremental, linear time)
    grammar.py   output constraints: JSON, Lark, forced tool calls (llguidance token masks)
    vocab.py     token bytes, special tokens, the plain-text encoder, llguidance's tokenizer
    metrics.py   Prometheus metrics
    protocol.py  request models, limits and error objects
    net.py       uvicorn settings (header read timeout)
"""

from .api import create_app
from .net import uvicorn_config

__all__ = ["create_app", "uvicorn_config"]
