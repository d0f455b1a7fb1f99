"""Tests run on the CPU: force JAX's CPU backend before anything imports jax.

Most of the suite's time is XLA compiling the engines' programs, and a program compiles once per engine. So the
engines that several test files use are built once per test process here (session fixtures), and the files
that share one are marked with the same `xdist_group`, so that `--dist loadgroup` runs them on one worker. Every
other file is a group of its own (pytest_collection_modifyitems below), so each file's module fixtures are built
once, as with `--dist loadfile`; a group's tests run in file order. A test that uses a shared engine leaves it as it found it: idle, every slot
and page free (generate, step_logits and the server's requests all end that way), its scheduler's spans and
runner's methods unpatched (monkeypatch), and it reads the scheduler's counters as differences or after
resetting them (`scheduler.stats = Stats()`), never as totals since the engine was built."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's backend optimisations cost more compile time than they save on the tests' tiny programs (a third
# off test_model's engine tests); subprocesses (the CLI and server tests) inherit it. GPU runs keep them.
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
sys.path.insert(0, os.path.dirname(__file__))  # the shared reference helpers (hf_reference.py)


import pytest  # noqa: E402

SMALL = dict(max_batch=4, max_seq_len=128, prefill_chunk=16, progress=False)  # the engine tests' geometry


# The groups that compile the most, in the order they start (longest first, measured on a 2-core machine), so that
# the workers end together; every other group follows in file order. xdist keeps this order with
# --no-loadscope-reorder (else it starts the groups with the most tests first).
FIRST = ("nvfp4", "ref4", "server", "test_model", "test_expert_kernel", "bundled", "test_cli", "test_hc_kernel")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test file without an xdist_group mark is a group of its own (before xdist reads the marks); the groups
    of FIRST go first, each keeping its tests' order."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    rank = {group: i for i, group in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.get_closest_marker("xdist_group").args[0], len(FIRST)))


_SHARED: list = []  # the session's shared engines, built so far


def _shared(engine):
    _SHARED.append(engine)
    return engine


@pytest.fixture(autouse=True)
def _shared_engines_left_clean():
    """After every test, each shared engine built so far is idle with every slot and page free: a test that left
    one otherwise fails here, not some later test that happens to use it."""
    yield
    for engine in _SHARED:
        sched = engine._scheduler
        if sched is not None:
            assert sched.idle and len(sched.free_slots) == sched.max_batch, "a shared engine was left busy"
            assert len(sched.free_pages) == sched.plan.num_pages, "a shared engine was left holding KV pages"


# ----- the bundled model ----------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def bundled():
    """The bundled model, float32, 3 slots of 192 tokens, 16-token prefill chunks: the scheduler's tests and the
    plain decoding that speculation on the bundled model must reproduce (group "bundled")."""
    import jaxflash

    return _shared(jaxflash.load(max_batch=3, max_seq_len=192, prefill_chunk=16, progress=False))


def _wait_health(url, until: int, deadline: float = 300.0) -> list:
    """Poll /health until it answers `until`; the statuses seen on the way."""
    import time

    import httpx

    seen, end = [], time.time() + deadline
    while time.time() < end:
        try:
            r = httpx.get(url + "/health")
            seen.append((r.status_code, r.json()["status"]))
            if r.status_code == until:
                return seen
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"/health did not answer {until}: {seen[-3:]}")


@pytest.fixture(scope="session")
def tiny_server_start():
    """One server on the bundled model for all the server tests, so that its programs compile once (group
    "server"): (url, the app's ServerState, what its start showed). Limits as in serving.py's tests: 1 MiB
    bodies, 2 s to send one, 1 s for headers, 64 waiting.

    Its loading is held until the server has answered while loading (/health and a model endpoint), then
    /health is polled through the warm-up until it says ok, and the programs compiled at that moment are
    recorded: test_server.py::test_health_and_queue_limits checks that record."""
    import threading

    import httpx

    from jaxflash.server import create_app
    from serving import KEY, load_small, serve

    gate = threading.Event()

    def held_load():
        if not gate.wait(300):
            raise RuntimeError("the test never released the load")
        return load_small()

    app = create_app(held_load, model_name="tiny", api_key=KEY, max_body_bytes=1 << 20, max_waiting=64,
                     body_timeout=2.0)
    state = app.state.jaxflash
    srv, url = serve(app, header_timeout=1.0, ready=503)
    try:
        start = {"health": _wait_health(url, 503),
                 "models": httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code}
        gate.set()
        start["health"] += _wait_health(url, 200)
        start["compiled"] = set(state.engine.scheduler.compile_counts())
        yield url, state, start
    finally:
        gate.set()
        srv.should_exit = True
        srv.thread.join(timeout=60)  # its shutdown stops the engine thread: nothing is left running at exit


@pytest.fixture(scope="session")
def tiny_server(tiny_server_start):
    """(url, ServerState) of the shared server (see tiny_server_start)."""
    return tiny_server_start[:2]


# ----- the reference model ----------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def ref4(tmp_path_factory):
    """transformers' qwen4_exp on a tiny random config, float64: 4 layers (3 GDN, 1 attention with QSA past its
    8-token budget, PLE at layer 2), every kind of state the engine keeps: (hf config, model, float32 checkpoint
    directory). Shared by test_engine.py and test_speculative.py (group "ref4"), and test_program_store.py;
    test_model.py checks the full forward on 8 layers."""
    from hf_reference import build_hf_model, save_checkpoint, tiny_hf_config

    hcfg = tiny_hf_config(num_hidden_layers=4, indexer_n_heads=8)
    model = build_hf_model(hcfg, seed=0)
    path = tmp_path_factory.mktemp("ref4_f32")
    save_checkpoint(model, path)
    return hcfg, model, path


@pytest.fixture(scope="session")
def ref4_engine(ref4):
    """The reference checkpoint in an engine of 4 slots of 128 tokens, 16-token prefill chunks."""
    import jaxflash

    return _shared(jaxflash.load(ref4[2], **SMALL))


# ----- a synthetic NVFP4 model: the layout the host expert pool holds -------------------------------------------
@pytest.fixture(scope="session")
def nvfp4_dir(tmp_path_factory):
    """A synthetic tiny model with NVFP4 experts (4 layers: 3 GDN, 1 attention, PLE at layer 2; 16 experts, top-4,
    an MTP head; group "nvfp4"). Four layers hold every kind of layer and state and compile in half the time."""
    from jaxflash import synthetic

    out = tmp_path_factory.mktemp("nvfp4")
    synthetic.make_model("tiny", "nvfp4", seed=5, out=str(out), num_layers=4, progress=False)
    return str(out)


@pytest.fixture(scope="session")
def nvfp4_mtp(nvfp4_dir):
    """Every expert on the device, and the MTP head run in every step (mtp_drafts): the reference that host
    residency (plain and speculative) must reproduce; drafting changes no token (test_engine.py checks)."""
    import jaxflash

    return _shared(jaxflash.load(nvfp4_dir, expert_residency="device", mtp_drafts=True, **SMALL))


@pytest.fixture(scope="session")
def nvfp4_plain(nvfp4_dir):
    """Every expert on the device, the MTP head loaded but not run (the default): the XLA path that the GDN and
    hyper-connection kernels must reproduce."""
    import jaxflash

    return _shared(jaxflash.load(nvfp4_dir, expert_residency="device", **SMALL))


@pytest.fixture(scope="session")
def nvfp4_host(nvfp4_dir):
    """The host expert pool with a cache of 8 slots per layer (the fewest 2 slots may need: 4 experts a token)
    and 2 slots: test_engine.py checks it against nvfp4_mtp, and test_expert_kernel.py's kernels against it."""
    import jaxflash

    return _shared(jaxflash.load(nvfp4_dir, expert_residency="host", cache_slots=8, **{**SMALL, "max_batch": 2}))


class SwitchedRouting:
    """A RoutingSource (runner.RoutingSource) that hands each call on to `source`, which a test sets: one engine
    with fixed routing serves tests of different routings, so that its programs compile once."""

    def __init__(self):
        self.source = None

    def prefill_ids(self, slot, n, width):
        return self.source.prefill_ids(slot, n, width)

    def decode_ids(self, batch):
        return self.source.decode_ids(batch)

    def verify_ids(self, batch, width):
        return self.source.verify_ids(batch, width)


@pytest.fixture(scope="session")
def _nvfp4_routed(nvfp4_dir):
    import jaxflash

    return _shared(jaxflash.load(nvfp4_dir, expert_residency="device", routing=SwitchedRouting(),
                                 **{**SMALL, "max_batch": 1}))


@pytest.fixture
def nvfp4_routed(_nvfp4_routed):
    """The NVFP4 model with every expert on the device, 1 slot, its expert ids from outside: the test sets
    `engine.routing.source` (a RoutingSource). Shared by test_engine.py's and test_speculative.py's fixed-routing
    tests; the source is cleared after each test."""
    yield _nvfp4_routed
    _nvfp4_routed.routing.source = None


@pytest.fixture(scope="session")
def trace_decode():
    """trace_decode(engine): trace (not compile) the engine's decode step with logits as its programs do, so that
    a test can see what it calls even when a shared engine's programs were built before the test patched
    something."""
    import jax

    from jaxflash.engine import runner as runner_mod
    from jaxflash.engine.runner import Want

    def trace(engine) -> None:
        r = engine.scheduler.runner
        state = jax.tree.unflatten(r._state_def, r._state_shapes)
        jax.eval_shape(lambda p, st: runner_mod.decode_step(p, r.setup, Want(logits=True), st, None, None),
                       r.params, state)

    return trace
