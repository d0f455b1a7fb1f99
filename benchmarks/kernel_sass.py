#!/usr/bin/env python3
"""The decode expert kernels' machine code for Hopper (sm_90), built on a machine without a GPU: registers and
instructions per byte of NVFP4 codes, the figures that bound a kernel whose time goes to issuing instructions
rather than to reading memory (benchmarks/RESULTS.md, "Decode expert kernels: where the time goes"). With
--kernels hc, the hyper-connection mix kernels' registers and spills at a few rows.

How: jax lowers the Pallas kernels of jaxflash.kernels.nvfp4_experts for a CUDA GPU on any machine
(`.lower(lowering_platforms=("cuda",))`); each pallas_call's Triton module is captured as text on its way into
the program, compiled by Triton (the pip wheel, the major version of the GPU image's) for sm_90 with the
kernel's warps and stages, and disassembled by the cuobjdump that Triton ships. No device is involved.

For each kernel it reports the registers per thread and shared memory (occupancy follows from them), the
local-memory loads and stores (spills), the SASS instructions in all and in the walk's loop body (the loop over
input chunks: one backward branch), that body's instructions by opcode, and instructions per byte of codes (the
loop body over the bytes one thread reads per step). A Hopper SM issues one instruction per clock in each of its
4 schedulers, so at full issue rate the 132 SMs of an H200 retire about 1.0e12 warp instructions per second: at N
instructions per byte a layer's 27.6 MB of codes (batch 1) need 27.6e6 * N / 32 / 1.0e12 s of issue alone.

Limits: on the GPU, XLA compiles these modules with the Triton bundled in jaxlib, not the pip wheel, so the counts
are close to, not equal to, the GPU's; the figures rank forms of a kernel, the GPU's trace times them.

    pip install triton==3.6.0                                                     # once (about 190 MB)
    python benchmarks/kernel_sass.py --out DIR                                    # the default tiles and math
    python benchmarks/kernel_sass.py --math f16x2,f32 --tiles "32:256:8:8:64:1;16:256:4:8:64:1" --tokens 1,8
    python benchmarks/kernel_sass.py --kernels hc --tokens 1,2,3,4,8 --out DIR   # the mix kernels
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from results_file import write_json  # noqa: E402

H, I, TOP_K = 2560, 640, 10  # the full-size model's expert shapes (docs/model.md)
ISSUE_RATE = 132 * 4 * 1.98e9  # warp instructions per second of an H200 (SMs x schedulers x boost clock)


def capture_triton_modules(fn, *args) -> list[tuple[str, str]]:
    """Lower fn(*args) for a CUDA GPU (no device needed); (kernel name, Triton module text) of each pallas_call,
    in program order. Reaches into jax's Pallas Triton lowering (a private module), so it names what it missed."""
    import jax
    from jax._src.pallas.triton import lowering, pallas_call_registration as registration

    captured, original = [], lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        result = original(*a, **kw)
        text = result.module.operation.get_asm(enable_debug_info=False)
        captured.append((re.search(r"tt\.func public @(\w+)", text).group(1), text))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = original
    if not captured:
        raise RuntimeError("no Triton module was captured: jax's Pallas Triton lowering moved")
    return captured


def compile_sm90(ttir_path: str, warps: int, stages: int) -> dict:
    """Compile a Triton module file for sm_90: {"registers", "shared", "sass"}."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise SystemExit(f"kernel_sass.py needs Triton: pip install triton==3.6.0 ({e})") from e
    kernel = triton.compile(ttir_path, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    cubin = ttir_path.rsplit(".", 1)[0] + ".cubin"
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)), "shared": int(kernel.metadata.shared),
            "sass": sass}


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of each instruction of a cuobjdump listing."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in
            (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) for line in sass.splitlines()) if m]


def opcode(text: str) -> str:
    """An instruction's opcode, its predicate and modifiers dropped: "@P0 LDG.E.64 R6, ..." -> "LDG"."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def loop_profile(sass: str) -> dict:
    """Instructions in all, and the body of the loop (from a backward branch's target to the branch) with its
    opcodes; several loops (a walk per token branch, collective loops): of those that hold no other loop, the
    one with the most global loads."""
    ins = instructions(sass)
    loops = [(int(m.group(1), 16), a) for a, t in ins
             if (m := re.search(r"BRA\s+0x([0-9a-f]+)", t)) and int(m.group(1), 16) < a]
    out = {"instructions": len(ins), "loop": 0, "opcodes": {}}
    if loops:
        inner = [(s, e) for s, e in loops if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops)]
        loads = lambda se: sum(a >= se[0] and a <= se[1] and "LDG" in t for a, t in ins)
        start, end = max(inner, key=lambda se: (loads(se), se[1] - se[0]))  # the walk: the weights' loads
        body = [t for a, t in ins if start <= a <= end]
        ops = collections.Counter(opcode(t) for t in body)
        out.update(loop=len(body), opcodes=dict(ops.most_common()))
    return out


def opcodes(sass: str) -> collections.Counter:
    """Every instruction of a listing by opcode."""
    return collections.Counter(opcode(t) for _, t in instructions(sass))


def spills(ops: collections.Counter) -> int:
    """Local-memory loads and stores: what the compiler spilled (the Pallas kernels have no local arrays)."""
    return ops["STL"] + ops["LDL"]


def expert_call(tiles, tokens: int, hidden: int = H, inter: int = I, top_k: int = TOP_K, experts: int = 16):
    """(fn, args) that lowering turns into both expert kernels of jaxflash.kernels.nvfp4_experts: `tokens` rows
    against resident NVFP4 experts of the given shapes (abstract: nothing is allocated; the expert count changes
    no instruction)."""
    import jax
    import jax.numpy as jnp

    from jaxflash.kernels import nvfp4_experts as K

    place = K.Placement(hidden, inter, *[K.Part(j, 0, kind)
                                         for j, kind in enumerate(["u8"] * 3 + ["f8"] * 3 + ["f32"] * 3)])
    ops = tuple(jax.ShapeDtypeStruct((experts, n), dt) for n, dt in
                [(inter * hidden // 2, jnp.uint8)] * 3 + [(inter * hidden // 16, jnp.float8_e4m3fn)] * 3
                + [(1, jnp.float32)] * 3)
    args = (jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16), jax.ShapeDtypeStruct((tokens, top_k), jnp.int32), ops)
    return (lambda x, ids, ops: K._pairs(x, ids, ops, place, tiles, False)), args, place


def expert_kernels(math: str, tiles, tokens: int, work: str) -> list[dict]:
    """Both expert kernels of jaxflash.kernels.nvfp4_experts for `tokens` rows at full size, compiled for sm_90."""
    import dataclasses

    from jaxflash.kernels import nvfp4_experts as K

    t = dataclasses.replace(tiles, math=math)
    fn, args, place = expert_call(t, tokens)
    modules = capture_triton_modules(fn, *args)
    fit = K.fit_tiles(place, t)
    shapes = {"nvfp4_gate_up": (fit.warps_gu, 2 * fit.rows_gu * fit.chunk_gu),  # gate and up: two matrices
              "nvfp4_down": (fit.warps_down, fit.rows_down * fit.chunk_down)}
    rows = []
    for name, text in modules:
        warps, step_bytes = shapes[name]
        path = os.path.join(work, f"{name}_{math}_n{tokens}.ttir")
        with open(path, "w") as f:
            f.write(text)
        c = compile_sm90(path, warps, fit.stages)
        sass = c.pop("sass")
        prof = loop_profile(sass)
        prof["spills"] = spills(opcodes(sass))
        per_thread = step_bytes / (warps * 32)
        rows.append({"kernel": name, "math": math, "tokens": tokens, "tiles": dataclasses.asdict(fit), "warps": warps,
                     **c, **prof, "bytes_per_thread_step": per_thread,
                     "per_byte": prof["loop"] / per_thread if prof["loop"] else None})
    return rows


def hc_call(rows: int, streams: int = 4, hidden: int = H, rank: int = 320, **tiles):
    """(fn, args) that lowering turns into the hyper-connection mix kernels of jaxflash.kernels.hc_mix for `rows`
    rows at the given shapes (the full size's by default), with a MoE block's output combined first, as the
    decode step's mixes after a MoE block run; tiles: hc_mix.mix's tile arguments."""
    import jax
    import jax.numpy as jnp

    from jaxflash.kernels import hc_mix

    w = streams * hidden
    sd = lambda shape, dt=jnp.float32: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    args = (sd((rows, w)), sd((w,), jnp.bfloat16), sd((rank, w), jnp.bfloat16), sd((w, rank), jnp.bfloat16),
            sd((streams, w), jnp.bfloat16), sd((rows, streams)), sd((rows, hidden)), sd((rows, hidden), jnp.bfloat16),
            sd((rows, 1)))

    def fn(h, norm, down, up, inject, inj0, routed, shared, gate):
        return hc_mix.mix(h, norm, down, up, inject, streams, 1e-6, pending=(inj0, routed, shared, gate),
                          x_dtype=jnp.bfloat16, interpret=False, **tiles)
    return fn, args


def hc_kernels(rows: int, work: str, **tiles) -> list[dict]:
    """The mix kernels for `rows` rows at full size, compiled for sm_90: registers, shared memory, instructions,
    spills and the global loads and barriers per program."""
    from jaxflash.kernels import hc_mix

    warps = tiles.get("warps") or hc_mix.WARPS
    up_warps = tiles.get("up_warps") or hc_mix.up_warps_for(rows)
    out, (fn, args) = [], hc_call(rows, **tiles)
    for name, text in capture_triton_modules(fn, *args):
        path = os.path.join(work, f"{name}_r{rows}.ttir")
        with open(path, "w") as f:
            f.write(text)
        nw = up_warps if name == "hc_mix_up" else warps
        c = compile_sm90(path, nw, 1)
        ops = opcodes(c.pop("sass"))
        out.append({"kernel": name, "rows": rows, "warps": nw, **c, "instructions": sum(ops.values()),
                    "spills": spills(ops), "global_loads": ops["LDG"], "barriers": ops["BAR"]})
    return out


def parse_tiles(spec: str):
    """'default', or expert_kernel.py's sweep entries without their math (--math gives it), ';'-separated."""
    from expert_kernel import pallas_tiles
    from jaxflash.kernels import nvfp4_experts as K

    if spec == "default":
        return [K.Tiles()]
    return [pallas_tiles(tuple(int(v) for v in s.split(":"))) for s in spec.split(";")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--math", default="auto", help="comma-separated product paths (Tiles.math)")
    ap.add_argument("--tiles", default="default",
                    help="'default' or rows_gu:chunk_gu:warps_gu:rows_down:chunk_down:warps_down[:unroll];...")
    ap.add_argument("--tokens", default="1", help="comma-separated token rows of the step")
    ap.add_argument("--kernels", default="experts",
                    help="comma-separated: experts (nvfp4_experts), hc (the hyper-connection mix, hc_mix, at --tokens "
                         "rows)")
    ap.add_argument("--hc-tiles", default="default",
                    help="the mix's tiles with --kernels hc: 'default' or hc_kernel.py's variants, "
                         "block_r:block_h:warps[:splits[:up_warps[:r_piece]]],... (fields left out: the defaults)")
    ap.add_argument("--out", default=None, help="folder for kernel_sass.json")
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="jaxflash_sass_")
    kinds = args.kernels.split(",")
    if "hc" in kinds:
        from hc_kernel import VARIANT_FIELDS, parse_variant

        variants = [{}] if args.hc_tiles == "default" else \
            [dict(zip(VARIANT_FIELDS, parse_variant(v))) for v in args.hc_tiles.split(",")]
        mixes = [{**r, "tiles": tiles} for tiles in variants for n in (int(v) for v in args.tokens.split(","))
                 for r in hc_kernels(n, work, **tiles)]
        print(f"{'kernel':14} {'rows':>4} {'tiles':>12} {'warps':>5} {'regs':>4} {'smem':>6} {'sass':>6} "
              f"{'spills':>6} {'LDG':>5} {'BAR':>4}")
        for r in mixes:
            tiles = ":".join(str(v) if v is not None else "-" for v in r["tiles"].values()) or "default"
            print(f"{r['kernel']:14} {r['rows']:4d} {tiles:>12} {r['warps']:5d} {r['registers']:4d} {r['shared']:6d} "
                  f"{r['instructions']:6d} {r['spills']:6d} {r['global_loads']:5d} {r['barriers']:4d}")
        write_json(args.out, "kernel_sass_hc.json", {"triton_target": "cuda sm_90", "rows": mixes})
    if "experts" not in kinds:
        return
    rows = []
    for tiles in parse_tiles(args.tiles):
        for math in args.math.split(","):
            for n in (int(v) for v in args.tokens.split(",")):
                rows += expert_kernels(math, tiles, n, work)
    print(f"{'kernel':14} {'math':6} {'rows':>4} {'tiles (rows:chunk:warps)':>24} {'regs':>4} {'smem':>6} {'sass':>5} "
          f"{'spill':>5} {'loop':>5} {'B/thr':>5} {'instr/B':>7}  loop opcodes")
    for r in rows:
        t = r["tiles"]
        shape = (f"{t['rows_gu']}:{t['chunk_gu']}:{t['warps_gu']}" if r["kernel"] == "nvfp4_gate_up"
                 else f"{t['rows_down']}:{t['chunk_down']}:{t['warps_down']}")
        per_byte = f"{r['per_byte']:7.2f}" if r["per_byte"] else "      -"
        ops = ", ".join(f"{k} {v}" for k, v in list(r["opcodes"].items())[:8])
        print(f"{r['kernel']:14} {r['math']:6} {r['tokens']:4d} {shape:>24} {r['registers']:4d} {r['shared']:6d} "
              f"{r['instructions']:5d} {r['spills']:5d} {r['loop']:5d} {r['bytes_per_thread_step']:5.0f} {per_byte}  "
              f"{ops}")
    codes = {"nvfp4_gate_up": TOP_K * I * H, "nvfp4_down": TOP_K * I * H // 2}  # bytes per layer, batch 1
    for m in args.math.split(","):
        first = [r for r in rows if r["math"] == m and r["per_byte"]][:2]  # the first tiles' two kernels
        us = sum(codes[r["kernel"]] * r["per_byte"] / 32 / ISSUE_RATE * 1e6 for r in first)
        print(f"{m}: the loop bodies' instructions over a batch-1 layer's codes at full issue rate: {us:.2f} us")
    write_json(args.out, "kernel_sass.json", {"triton_target": "cuda sm_90", "shapes": {"hidden": H, "inter": I},
                                              "rows": rows})


if __name__ == "__main__":
    main()
