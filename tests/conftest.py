"""Tests run on the CPU: force JAX's CPU backend before anything imports jax."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))  # the shared reference helpers (hf_reference.py)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_server():
    """One server on the bundled model for all the server tests, so that its programs compile once: (url, the
    app's ServerState). Limits as in serving.py's tests: 1 MiB bodies, 2 s to send one, 1 s for headers."""
    from jaxflash.server import create_app
    from serving import KEY, load_small, serve

    app = create_app(load_small, model_name="tiny", api_key=KEY, max_body_bytes=1 << 20, max_waiting=64,
                     body_timeout=2.0)
    srv, url = serve(app, header_timeout=1.0)
    yield url, app.state.jaxflash
    srv.should_exit = True
    srv.thread.join(timeout=60)  # its shutdown stops the engine thread: nothing is left running at exit
