#!/usr/bin/env python3
"""Programmatic dependent launch (PDL) for Pallas (Triton backend) kernels inside XLA's command buffer: does a
kernel that calls griddepcontrol start before its predecessor ends, and what does a chain of them gain?

A chain of L product kernels y_{l+1} = W_l y_l (bf16 [N, N], one jitted program; `--tiles`: output rows and
warps per program) in one of three forms:
  plain   no griddepcontrol;
  pdl     `griddepcontrol.launch_dependents` when a program starts (the next kernel may launch) and
          `griddepcontrol.wait` after its weight tile is loaded, before it reads y (the predecessor's output);
  wait    the wait alone.
The instructions go in through Pallas' inline assembly, tied to the input's address by a value the compiler
cannot see through (the assembly returns its operand, 0). Reported: wall time per kernel over repeated calls,
and from a profiler trace of 3 calls the kernels' own durations and the median gap between one kernel's end
and the next one's start (negative: they overlap).

    python3 benchmarks/pdl_probe.py --out $OUT                     # on a Hopper GPU
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trace_parts import gpu_kernels  # noqa: E402
from results_file import write_json  # noqa: E402

FORMS = ("plain", "pdl", "wait")
_WAIT = "griddepcontrol.wait;\nmov.b32 $0, $1;"
_TRIGGER = "griddepcontrol.launch_dependents;\nmov.b32 $0, $1;"


def chain_program(form: str, n: int, rows: int, warps: int):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    def asm(code, v):
        [r] = plt.elementwise_inline_asm(code, args=[v], constraints="=r,r", pack=1,
                                         result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, jnp.int32)])
        return r

    def kernel(w_ref, x_ref, o_ref):
        out = pl.program_id(0) * rows + jnp.arange(rows, dtype=jnp.int32)
        cols = jnp.arange(n, dtype=jnp.int32)
        zero = jnp.zeros((1,), jnp.int32)
        if form == "pdl":
            zero = asm(_TRIGGER, zero)
        w = w_ref[out[:, None] * n + cols[None, :]].astype(jnp.float32)
        if form in ("pdl", "wait"):
            zero = asm(_WAIT, zero)
        x = x_ref[cols + jnp.sum(zero)].astype(jnp.float32)
        o_ref[out] = jnp.sum(w * x[None, :], axis=1).astype(o_ref.dtype)

    def product(w, x):
        whole = lambda s: pl.BlockSpec(s, lambda i: (0,))  # noqa: E731
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.bfloat16), grid=(n // rows,),
                              in_specs=[whole(w.shape), whole(x.shape)], out_specs=whole((n,)),
                              compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1),
                              name=f"pdl_probe_{form}")(w, x)

    @jax.jit
    def chain(ws, x):
        for w in ws:
            x = product(w, x)
        return x

    return chain


def run(form: str, layers: int, n: int, rows: int, warps: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    chain = chain_program(form, n, rows, warps)
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    ws = [(jax.random.normal(k, (n * n,), jnp.float32) * n ** -0.5).astype(jnp.bfloat16) for k in keys]
    y = chain(ws, jnp.ones((n,), jnp.bfloat16))
    for _ in range(5):
        y = chain(ws, y)
    y.block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        y = chain(ws, y)
    y.block_until_ready()
    wall = (time.perf_counter() - t) / reps
    trace_dir = tempfile.mkdtemp(prefix="pdl_probe_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(3):
            y = chain(ws, y)
        y.block_until_ready()
    ev = [e for e in gpu_kernels(trace_dir) if "pdl_probe" in e.get("name", "")]
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(ev, ev[1:])]
    return {"form": form, "rows": rows, "warps": warps, "layers": layers, "n": n,
            "us_per_kernel_wall": wall / layers * 1e6, "tb_s": n * n * 2 / (wall / layers) / 1e12,
            "kernels_traced": len(ev), "kernel_us_median": statistics.median(e["dur"] for e in ev),
            "gap_us_median": statistics.median(gaps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forms", default="plain,pdl,wait")
    ap.add_argument("--tiles", default="16x4,8x4,4x4,2x2", help="rows per program x warps, comma-separated")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--n", type=int, default=2048, help="matrix side (a power of two: Triton blocks)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None, help="directory for pdl_probe.json")
    args = ap.parse_args(argv)
    import jax

    forms = args.forms.split(",")
    if not set(forms) <= set(FORMS):
        ap.error(f"--forms takes {FORMS}")
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "runs": []}
    print(f"device {res['device']}, jax {res['jax']}: {args.layers} products of [{args.n}, {args.n}] bf16 chained")
    for tile in args.tiles.split(","):
        rows, warps = (int(v) for v in tile.split("x"))
        for form in forms:
            r = run(form, args.layers, args.n, rows, warps, args.reps)
            res["runs"].append(r)
            print(f"  {rows:3d} rows x {warps} warps {form:6s} {r['us_per_kernel_wall']:6.2f} us/kernel "
                  f"({r['tb_s']:.2f} TB/s); traced: kernel {r['kernel_us_median']:.2f} us, gap "
                  f"{r['gap_us_median']:+.2f} us", flush=True)
    write_json(args.out, "pdl_probe.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
