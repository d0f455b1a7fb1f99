#!/usr/bin/env python3
"""How fast the decode expert kernels could read their bytes: the kernels (jaxflash/kernels/nvfp4_experts.py)
against kernels that read the same NVFP4 bytes and do almost no arithmetic, on full-size shapes, batch 1.

  * kernel: the two kernels of the step (gate_up, down), timed apart;
  * loads: Pallas kernels over the same pairs that read whole rows of gate and up (or of down) with their block
    scales, `rows` rows per program with 4 warps, every byte requested before any arithmetic, and only sum the
    bytes as integers: the floor of reading this way, one launch per matrix family;
  * loads_fused: one launch for all three matrices: a program reads its block of gate/up rows, then the columns
    of down that its activations meet (down split by inputs across programs, partial sums left to a reduction);
  * xla: XLA's own fusions reading the same experts' bytes (a gather and an integer sum);
  * xla_contiguous: XLA's sum over a contiguous buffer of the same size: what one launch reading that many
    bytes reaches at best here.

Each runs L layers chained in one jitted program (each layer its own 512 experts, so nothing stays in L2),
calibrated routing; GPU kernel time from a profiler trace, per layer.

    python3 benchmarks/expert_probe.py --out $OUT          # on the H200
    python3 benchmarks/expert_probe.py --preset tiny --layers 2 --rows-gu 8 --rows-down 16 --fused 16x1
                                                           # CPU smoke run (interpret mode; no kernel times)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel_timing import COPY_CEILING, log  # noqa: E402


def pieces(groups: int):
    """A row's 16-code groups as power-of-two runs (first, count), largest first (Triton blocks are powers of two)."""
    out, at = [], 0
    for bit in reversed(range(groups.bit_length())):
        if groups >> bit & 1:
            out.append((at, 1 << bit))
            at += 1 << bit
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "tiny"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows-gu", default="8,16", help="rows per program of the gate/up loads probe")
    ap.add_argument("--rows-down", default="16,32,64", help="rows per program of the down loads probe")
    ap.add_argument("--fused", default="32x4,32x8,64x8",
                    help="rows x warps of the one-launch probe: a program reads its gate/up rows and then the down "
                         "columns those activations meet (a split of down's inputs across programs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl

    from expert_kernel import kernel_time_us, random_experts, routing_ids
    from jaxflash.kernels import compiler_params, on_gpu
    from jaxflash.kernels import nvfp4_experts as K
    from trace_parts import gpu_kernels

    E, H, I, k = (512, 2560, 640, 10) if args.preset == "full" else (16, 64, 32, 4)
    L, interpret = args.layers, not on_gpu()
    layers = [random_experts(kk, E, H, I) for kk in jax.random.split(jax.random.key(0), L)]
    ops = [K.resident_operands(ex)[1] for ex in layers]
    place = K.resident_operands(layers[0])[0]
    ids = jnp.asarray(routing_ids("batch", 1, L, E, k, "calibrated" if args.preset == "full" else "uniform", 0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, H)), jnp.bfloat16)
    w = jnp.full((1, k), 0.1, jnp.bfloat16)
    per_matrix = I * H // 2 + I * H // 16  # codes and block scales of one matrix of one expert
    bytes_gu, bytes_down = k * 2 * per_matrix, k * per_matrix

    def read_rows(wr, part, spart, e, row0, rows, in_dim):
        """sum over rows row0.. (whole) of codes x block scale, as integers and float32: [rows]. The bytes are
        addressed by the decode kernels' own tile helpers."""
        acc = None
        for g0, n in pieces(in_dim // K.NVFP4_GROUP):
            codes = K._codes(wr, part, e, K._block_offsets(row0, rows, in_dim // 2, g0 * 8, n))
            sc = K._scales(wr, spart, e, K._scale_offsets(row0, rows, in_dim // K.NVFP4_GROUP, g0, n), 1.0)
            part_sum = jnp.sum(jnp.sum(codes.astype(jnp.int32), axis=-1).astype(jnp.float32) * sc, axis=-1)
            acc = part_sum if acc is None else acc + part_sum
        return acc

    def read_columns(wr, part, spart, e, col0, cols, out_dim, in_dim):
        """sum over all out_dim rows of the bytes of inputs col0..col0+cols (cols/2 bytes a row) x block scale:
        the down columns that a block of `cols` activations meets. float32 [block]."""
        acc, block = None, min(512, out_dim)
        for r0 in range(0, out_dim, block):
            r = jnp.arange(block, dtype=jnp.int32)[:, None]
            c = jnp.arange(cols // 2, dtype=jnp.int32)[None, :]
            codes = wr[part.arg][e, part.offset + (r0 + r) * (in_dim // 2) + col0 // 2 + c]
            s = jnp.arange(max(1, cols // 16), dtype=jnp.int32)[None, :]
            sc = wr[spart.arg][e, spart.offset + (r0 + r) * (in_dim // 16) + col0 // 16 + s].astype(jnp.float32)
            part_sum = jnp.sum(codes.astype(jnp.int32), axis=-1).astype(jnp.float32) * jnp.sum(sc, axis=-1)
            acc = part_sum if acc is None else acc + part_sum
        return acc

    def loads_kernel(ids_ref, *refs, rows, family):
        *wr, out_ref = refs
        e = ids_ref[pl.program_id(0)]
        row0 = pl.program_id(1) * rows
        if family == "fused":  # gate/up rows row0.., then the down columns those activations meet
            acc = (read_rows(wr, place.gate, place.gate_scale, e, row0, rows, H)
                   + read_rows(wr, place.up, place.up_scale, e, row0, rows, H))
            d = read_columns(wr, place.down, place.down_scale, e, row0, rows, H, I)
            out_ref[pl.program_id(0), row0 + jnp.arange(rows, dtype=jnp.int32)] = acc + jnp.sum(d)
            return
        if family == "gate_up":
            acc = (read_rows(wr, place.gate, place.gate_scale, e, row0, rows, H)
                   + read_rows(wr, place.up, place.up_scale, e, row0, rows, H))
        else:
            acc = read_rows(wr, place.down, place.down_scale, e, row0, rows, I)
        out_ref[pl.program_id(0), row0 + jnp.arange(rows, dtype=jnp.int32)] = acc

    def loads(o, ids_l, rows, family, warps=4):
        n_out = H if family == "down" else I
        return pl.pallas_call(partial(loads_kernel, rows=rows, family=family),
                              out_shape=jax.ShapeDtypeStruct((k, n_out), jnp.float32), grid=(k, n_out // rows),
                              compiler_params=compiler_params(interpret, warps), interpret=interpret,
                              name=f"probe_{family}")(ids_l.reshape(-1), *o)

    def xla_read(ex, ids_l, family):
        sel = ids_l.reshape(-1)
        mats = (ex.gate, ex.up) if family == "gate_up" else (ex.down,)
        return sum(jnp.take(m.packed, sel, axis=0).astype(jnp.int32).sum(axis=(1, 2))
                   + jnp.take(m.scale, sel, axis=0).astype(jnp.float32).sum(axis=(1, 2)).astype(jnp.int32)
                   for m in mats).astype(jnp.float32)

    def chain(step):
        def run(arg, x, ids):
            acc = jnp.zeros((), jnp.float32)
            for layer in range(L):
                y = step(arg[layer], x, ids[layer] + (acc > 1e30).astype(jnp.int32))  # layers depend on each other
                acc = acc + jnp.sum(y) * 1e-30
            return acc
        return jax.jit(run)

    # name: (program, its argument, {figure: (kernel-name match, bytes)})
    variants = {"kernel": (chain(lambda o, x, i: K.routed_experts(place, o, x, i, w)), ops,
                           {"gate_up": ("nvfp4_gate_up", bytes_gu), "down": ("nvfp4_down", bytes_down)})}
    for fam, rows_list, nb in (("gate_up", args.rows_gu, bytes_gu), ("down", args.rows_down, bytes_down)):
        for r in (int(v) for v in rows_list.split(",")):
            variants[f"loads_{fam}_r{r}"] = (chain(lambda o, x, i, r=r, fam=fam: loads(o, i, r, fam)), ops,
                                             {fam: (f"probe_{fam}", nb)})
        variants[f"xla_{fam}"] = (chain(lambda ex, x, i, fam=fam: xla_read(ex, i, fam)), layers, {fam: (None, nb)})
    for fam, nb in (("gate_up", bytes_gu), ("down", bytes_down)):  # the same byte count, contiguous, one reduce
        bufs = [jnp.full((nb // 4,), layer + 1, jnp.uint32) for layer in range(L)]
        variants[f"xla_contiguous_{fam}"] = (chain(lambda b, x, i: jnp.sum(b ^ i[0, 0].astype(jnp.uint32))
                                                   .astype(jnp.float32)), bufs, {fam: (None, nb)})
    for r, wp in ((int(v), int(u)) for v, u in (c.split("x") for c in args.fused.split(","))):
        variants[f"loads_fused_r{r}_w{wp}"] = (chain(lambda o, x, i, r=r, wp=wp: loads(o, i, r, "fused", wp)), ops,
                                               {"fused": ("probe_fused", bytes_gu + bytes_down)})
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": L, "shape": [E, H, I, k],
           "bytes_gate_up": bytes_gu, "bytes_down": bytes_down, "variants": {}}
    for name, (fn, arg, figures) in variants.items():
        try:
            fn(arg, x, ids).block_until_ready()
            tdir = tempfile.mkdtemp(prefix="probe_")
            with jax.profiler.trace(tdir, create_perfetto_trace=True):
                for _ in range(3):
                    fn(arg, x, ids).block_until_ready()
            ev = gpu_kernels(tdir)
            r = {"all_us_per_layer": kernel_time_us(ev, lambda s: True)[0] / 3 / L}
            for fig, (match, nb) in figures.items():
                hit = (lambda s, m=match: m in s) if match else (lambda s: "fusion" in s and "add_fusion" not in s)
                us, n = kernel_time_us(ev, hit)
                us = us / 3 / L
                r[fig] = {"us_per_layer": us, "kernels_per_layer": n / 3 / L, "mb": nb / 1e6,
                          "floor_us": nb / COPY_CEILING * 1e6, "tbps": nb / (us * 1e-6) / 1e12 if us else float("nan")}
        except Exception as exc:  # a variant that fails is reported, the others run
            r = {"error": repr(exc)[-500:]}
        res["variants"][name] = r
        log(f"{name:18} " + ", ".join(f"{f}: {v['us_per_layer']:.2f} us ({v['tbps']:.2f} TB/s, floor "
                                      f"{v['floor_us']:.2f} us)" for f, v in r.items() if isinstance(v, dict))
            + (f" ERROR {r['error']}" if "error" in r else ""))
    out = args.out or tempfile.mkdtemp(prefix="probe_")
    with open(os.path.join(out, "expert_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    log(f"per layer, batch 1; floors at {COPY_CEILING / 1e12:.1f} TB/s. Results: {out}/expert_probe.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
