#!/usr/bin/env python3
"""Does XLA update a step's CUDA graph on every call? A probe on a small stand-in for the decode step.

XLA replays a program's captured part as a CUDA graph and re-records it (`command_buffer::update` in a
profiler trace) whenever a buffer the graph touches has moved since the last call. This runs a step of
`--layers` small matvec layers over a donated state, in several variants, for `--calls` calls each inside a
profiler trace, and counts the graph updates per call:

    plain      step(weights, state) -> state                       (donated state only)
    outputs    step(weights, state) -> (state, outputs)            (fresh output buffers every call)
    copied     outputs made by jaxflash.ffi.uncaptured_copy        (copied outside the graph)
    input      step(weights, state, x) -> state with a fresh x     (a per-call input read by the graph)
    input_cp   the same with x copied in by uncaptured_copy
each called back to back (dispatch n+1 before n finishes) and, as `..._sync`, waiting for every call.

    python benchmarks/graph_updates.py            # on the GPU; prints one line per variant
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def updates_in(trace_dir: str) -> tuple[int, int, list]:
    """(command_buffer::update events, cuGraphLaunch events, the command counts of the updated graphs) on the
    host side of the newest trace."""
    f = max(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True), key=os.path.getmtime)
    with gzip.open(f, "rt") as fh:
        tr = json.load(fh)
    ev = tr["traceEvents"] if isinstance(tr, dict) else tr
    names = [e.get("name", "") for e in ev if e.get("ph") == "X"]
    sizes = sorted({e.get("args", {}).get("num_commands") for e in ev if e.get("name") == "command_buffer::update"},
                   key=str)
    return sum(n == "command_buffer::update" for n in names), sum(n.startswith("cuGraphLaunch") for n in names), sizes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--out", default=None, help="write results.json here")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxflash import ffi

    n, w = args.layers, args.width
    weights = [jnp.asarray(np.random.default_rng(i).standard_normal((w, w)) / w ** 0.5, jnp.bfloat16)
               for i in range(n)]

    def body(ws, h, x=None):
        if x is not None:
            h = h + x
        for m in ws:  # one matvec + one elementwise fusion per layer: a long graph
            h = jnp.tanh((h.astype(jnp.bfloat16) @ m).astype(jnp.float32)) + 0.5 * h
        return h

    variants = {
        "plain": lambda ws, st: (body(ws, st),),
        "outputs": lambda ws, st: (body(ws, st), jnp.sum(st) + 1.0),
        "copied": lambda ws, st: (body(ws, st), ffi.uncaptured_copy(jnp.sum(st) + 1.0)),
        "input": lambda ws, st, x: (body(ws, st, x),),
        "input_cp": lambda ws, st, x: (body(ws, st, ffi.uncaptured_copy(x)),),
        # outputs that depend on the step's end, copied out; and outputs kept in a donated outbox instead
        "copied_end": lambda ws, st: (lambda h: (h, ffi.uncaptured_copy(jnp.sum(h) + 1.0)))(body(ws, st)),
        "outbox": lambda ws, st: (lambda h: (h.at[0, 0].set(jnp.sum(h)),))(body(ws, st)),
    }
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "layers": n, "width": w,
           "calls": args.calls, "variants": {}}
    for name, fn in variants.items():
        takes_x = name.startswith("input")
        step = jax.jit(fn, donate_argnums=1)
        for sync in (False, True):
            st = jnp.zeros((1, w), jnp.float32)
            x = jnp.ones((1, w), jnp.float32)
            for _ in range(3):  # compile, record
                out = step(weights, st, x) if takes_x else step(weights, st)
                st = out[0]
            jax.block_until_ready(st)
            d = tempfile.mkdtemp(prefix="jaxflash_graph_updates_")
            keep = []
            t0 = time.perf_counter()
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(args.calls):
                    xi = jnp.full((1, w), 1.0, jnp.float32) if takes_x else None  # a fresh input buffer
                    out = step(weights, st, xi) if takes_x else step(weights, st)
                    st = out[0]
                    keep.append(out[1:])  # outputs stay alive, as a scheduler holds them until read
                    if sync:
                        jax.block_until_ready(st)
                jax.block_until_ready(st)
            dt = (time.perf_counter() - t0) / args.calls
            upd, launches, sizes = updates_in(d)
            label = name + ("_sync" if sync else "")
            res["variants"][label] = {"updates_per_call": upd / args.calls, "launches_per_call": launches / args.calls,
                                      "ms_per_call_traced": dt * 1e3, "updated_graph_sizes": sizes}
            print(f"{label:14s} graph updates/call {upd / args.calls:5.2f}  launches/call "
                  f"{launches / args.calls:5.2f}  {dt * 1e3:7.2f} ms/call (traced); updated graphs of "
                  f"{sizes} commands", flush=True)
            if label == "copied_sync":
                with open(os.path.join(args.out or d, "copied_hlo.txt"), "w") as f:
                    f.write(step.lower(weights, st).compile().as_text())
    if args.out:
        with open(os.path.join(args.out, "graph_updates.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
