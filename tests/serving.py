"""What the server tests share: a real uvicorn server on the bundled model, and grammars forcing an output."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx

import jaxflash
from jaxflash.server import uvicorn_config
from jaxflash.tokenizer import Tokenizer

KEY = "sk-test"
ADDED = r"</?tool_call>|</?think>"


def forced(tok: Tokenizer, text: str) -> str:
    """A Lark grammar whose only sentence is `text` (tool/think markup as the tokenizer's own tokens)."""
    parts = [p for p in re.split(f"({ADDED})", text) if p]
    return "start: " + " ".join(f"<[{tok.token_to_id(p)}]>" if re.fullmatch(ADDED, p) else json.dumps(p)
                                for p in parts)


def serve(app, ready: int = 200, **config):
    """Run `app` under uvicorn (the server's own settings, `config` on top) on a free port until /health answers
    `ready` (200: healthy; 503: up, the model still loading). uvicorn's loggers are left to propagate, so caplog
    sees what the server logs."""
    import uvicorn

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None,
                                           **config))
    server.thread = threading.Thread(target=server.run, daemon=True)  # join it after should_exit
    server.thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health").status_code == ready:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"/health never answered {ready}")


def load_small():
    engine = jaxflash.load(max_batch=4, max_seq_len=512, prefill_chunk=64, progress=False)
    return engine, Tokenizer(jaxflash.DEFAULT_MODEL)
