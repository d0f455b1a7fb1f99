"""The program store (jaxflash/engine/program_store.py): compiled programs found again without tracing.

In one process: programs stored by one compile are loaded by the next (the runner's own programs dropped), and
generate what the compiled ones generate; a corrupt file is a miss that compiles again; a key changes with the
setup and with anything the store cannot describe by value. tests/test_cli.py checks a second process.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

import jaxflash
from jaxflash.engine import program_store


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(program_store, "directory", lambda: tmp_path)
    return tmp_path


def test_stored_programs_are_loaded_and_generate_the_same(store, ref4, caplog):
    # conftest.py's 4-layer reference checkpoint: the store does not care which model, and its programs compile
    # in half the time of the bundled model's 8 layers (this test compiles them twice)
    e = jaxflash.load(ref4[2], max_batch=1, max_seq_len=64, prefill_chunk=16, progress=False)
    sch = e.scheduler
    programs = sch.programs(serving=False)  # admit, release, prefill, decode@1
    with caplog.at_level(logging.INFO, logger="jaxflash"):
        sch.runner.compile(programs)
    assert len(list(store.glob("*.bin"))) == 4
    assert sum("compiled " in m for m in caplog.messages) == 4
    want = e.generate([[1, 2, 3, 4, 5]], max_new_tokens=6, ignore_eos=True)

    sch.runner._programs.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxflash"):
        sch.runner.compile(programs)
    assert sum("loaded " in m for m in caplog.messages) == 4
    assert e.generate([[1, 2, 3, 4, 5]], max_new_tokens=6, ignore_eos=True) == want
    old = list(sch.runner._state)  # a loaded program still donates the state it replaces (no second copy)
    sch.runner.release(0)
    assert all(a.is_deleted() for a in old)

    for f in store.glob("*.bin"):  # a damaged store: every program compiles again, with a warning
        f.write_bytes(b"not a program")
    sch.runner._programs.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxflash"):
        sch.runner.compile(programs)
    assert sum("did not load" in m for m in caplog.messages) == 4
    assert sum("compiled " in m for m in caplog.messages) == 4
    assert e.generate([[1, 2, 3, 4, 5]], max_new_tokens=6, ignore_eos=True) == want


def test_keys_follow_the_setup():
    e = jaxflash.load(None, max_batch=2, max_seq_len=64, prefill_chunk=16, progress=False)
    r = e.scheduler.runner

    def key(setup, rows=1):
        return program_store.fingerprint(f"decode@{rows}", setup, r._params, r._params_def, r._state_shapes,
                                         r._state_def, r._inputs(*r._key("decode", None, rows)))

    base = key(r.setup)
    assert key(r.setup) == base
    assert key(r.setup, rows=2) != base
    assert key(dataclasses.replace(r.setup, max_batch=4)) != base
    assert key(dataclasses.replace(r.setup, table_scale=0.5)) != base
    assert key(dataclasses.replace(r.setup, cfg=r.setup.cfg.replace(rms_norm_eps=1e-5))) != base

    class Opaque:  # described by repr: its address, so two of them never share a key
        pass

    assert program_store.describe(Opaque()) != program_store.describe(Opaque())
