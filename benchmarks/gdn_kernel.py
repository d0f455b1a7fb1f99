#!/usr/bin/env python3
"""The GDN decode kernel (jaxflash/kernels/gdn_decode.py) against XLA's form of the same step, full-size shapes.

L GDN layers of one decode token (batch 1, as the engine runs it: vmapped over the batch) in one jitted program,
each layer with its own weights and state, in two scopes:
  * recurrent: the part the kernel replaces (conv, gates, l2norms, the delta rule on the float32 state, the
    gated RMSNorm), from the projections' outputs to o; the kernel at several warp counts against XLA;
  * layer: the whole gated_deltanet (projections included), kernel=False against kernel=True.
Per layer it reports the summed GPU kernel time from a profiler trace, the kernels per layer, the bytes the
scope must move (the state read and written; plus the weights for the layer) and the fraction of 4.2 TB/s.
It first checks the kernel's numerics against XLA's on the GPU.

    python3 benchmarks/gdn_kernel.py --out $OUT                 # on the H200
    python3 benchmarks/gdn_kernel.py --preset tiny --layers 2   # CPU smoke run (interpret mode)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_timing import COPY_CEILING, log, Stepper, rel_err, trace_kernels, wall_us  # noqa: E402
from results_file import write_json  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "tiny"])
    ap.add_argument("--layers", type=int, default=36, help="GDN layers in one program (the full model has 36)")
    ap.add_argument("--variants", default="4:32,2:16,4:16,1:16,8:64,4:128",
                    help="comma-separated kernel variants warps:block_v (value columns per program)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxflash import presets
    from jaxflash.kernels import gdn_decode, on_gpu
    from jaxflash.model import gated_deltanet as gdn
    from jaxflash.model.base import silu, up
    from jaxflash.model.norms import l2norm, rms_norm_gated

    cfg = presets.preset(args.preset)
    dt = jnp.bfloat16
    L = args.layers
    dev = jax.devices()[0]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, c, k = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
    h = cfg.hidden_size
    log(f"device {dev.device_kind}, jax {jax.__version__}; {args.preset}: {L} GDN layers, Hk {hk} Hv {hv} dk {dk} "
        f"dv {dv}, conv {c}x{k}, bf16, batch 1")
    key = jax.random.PRNGKey(0)

    def rnd(key, shape, scale=0.05, dtype=dt):
        return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)

    def one_layer(key):  # separate buffers per layer, as the engine holds them (slices of a stack would copy)
        ks = jax.random.split(key, 9)
        return gdn.GatedDeltaNet(
            in_proj=rnd(ks[0], (c + hv * dv + 2 * hv, h), 0.02),
            conv1d=rnd(ks[4], (c, k), 0.3), dt_bias=rnd(ks[5], (hv,), 0.5), A_log=rnd(ks[6], (hv,), 0.5),
            norm=1 + rnd(ks[7], (dv,), 0.1), out_proj=rnd(ks[8], (h, hv * dv), 0.02))

    def one_state(key):
        k1, k2 = jax.random.split(key)
        return gdn.GDNState(conv=rnd(k1, (1, k - 1, c), 1.0), recurrent=rnd(k2, (1, hv, dk, dv), 0.05, jnp.float32))

    def one_raw(key):  # the stacked input projection's output of batch 1: qkv | z | b | a
        return rnd(key, (1, 1, c + hv * dv + 2 * hv), 1.0)

    def parts(p, proj):  # [1, 1, W] -> qkv [1, 1, C], z [1, Hv, dv], b and a [1, Hv]
        qkv, z, b, a = jnp.split(proj, list(p._edges()), axis=-1)
        return qkv, z.reshape(1, hv, dv), b[:, 0], a[:, 0]

    keys = jax.random.split(key, 3 * L + 1)
    layers = [one_layer(keys[i]) for i in range(L)]
    state0 = [one_state(keys[L + i]) for i in range(L)]
    raw = [one_raw(keys[2 * L + i]) for i in range(L)]
    x = rnd(keys[-1], (1, 1, h), 1.0)
    live = jnp.ones((1, 1), jnp.int32)
    fresh = lambda: jax.tree.map(jnp.copy, state0)  # noqa: E731  (each program donates the state it is given)

    def xla_recurrent(p, qkv_raw, z, b, a, conv_state, rec):  # gated_deltanet's own code between projections
        conv_out, hist = gdn.causal_conv(qkv_raw, conv_state, p.conv1d)
        qkv = silu(up(conv_out)).astype(dt)
        kd = hk * dk
        q = l2norm(jnp.repeat(qkv[:, :kd].reshape(1, hk, dk), hv // hk, axis=1)) * dk ** -0.5
        kk = l2norm(jnp.repeat(qkv[:, kd:2 * kd].reshape(1, hk, dk), hv // hk, axis=1))
        v = up(qkv[:, 2 * kd:].reshape(1, hv, dv))
        beta = jax.nn.sigmoid(up(b))[None]
        g = (-jnp.exp(up(p.A_log)) * jax.nn.softplus(up(a) + p.dt_bias))[None]
        o, rec = gdn.recurrent_gated_delta_rule(q, kk, v, g, beta, rec)
        o = rms_norm_gated(o.astype(dt), z[None], p.norm, cfg.rms_norm_eps, cfg.output_gate_type)
        return o[0], hist[1:], rec

    def kernel_recurrent(p, proj, conv_state, rec, warps, block_v):  # the same with the kernel
        _, z, _, _ = parts(p, proj)
        o, conv_state, rec = gdn_decode.recurrent_step(cfg, proj[:, 0], live[:, 0], p.conv1d, p.dt_bias, p.A_log,
                                                       conv_state, rec, warps=warps, block_v=block_v)
        o = rms_norm_gated(o, z, p.norm, cfg.rms_norm_eps, cfg.output_gate_type)
        return o, conv_state, rec

    def recurrent_program(variant):
        def one(p, r, st):
            if variant is None:
                qkv, z, b, a = parts(p, r)
                o, cs, rec = jax.vmap(lambda *t: xla_recurrent(p, *t))(qkv, z, b, a, st.conv, st.recurrent)
            else:
                o, cs, rec = kernel_recurrent(p, r, st.conv, st.recurrent, *variant)
            return o, gdn.GDNState(conv=cs, recurrent=rec)

        def run(sts, ps, raw):
            outs = [one(ps[i], raw[i], sts[i]) for i in range(L)]
            return [o for o, _ in outs], [s for _, s in outs]
        return Stepper(jax.jit(run, donate_argnums=0), fresh(), layers, raw)

    def layer_program(kernel):
        def run(sts, ps, x):
            new = []
            for i in range(L):
                y, s = gdn.gated_deltanet_batch(ps[i], cfg, x, sts[i], jnp.ones(1, jnp.int32), kernel)
                x = x + y.astype(dt)
                new.append(s)
            return x, new
        return Stepper(jax.jit(run, donate_argnums=0), fresh(), layers, x)

    res = {"device": str(dev.device_kind), "jax": jax.__version__, "python": platform.python_version(),
           "preset": args.preset, "layers": L, "reps": args.reps, "runs": []}
    state_bytes = hv * dk * dv * 4 * 2 + (k - 1) * c * 2 * 2  # the float32 state and the conv state, read + write
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(layers[0]))
    gpu = on_gpu()

    ref_o, ref_s = recurrent_program(None)()
    variants = [tuple(int(n) for n in v.split(":")) for v in args.variants.split(",")]
    for w in variants:
        o, s = recurrent_program(w)()
        err_o = rel_err(o, ref_o)
        err_s = rel_err([t.recurrent for t in s], [t.recurrent for t in ref_s])
        conv_same = all(np.array_equal(np.asarray(t.conv, np.float32), np.asarray(r.conv, np.float32))
                        for t, r in zip(s, ref_s))
        log(f"numerics, kernel {w[0]} warps x {w[1]} columns vs XLA: o {err_o:.2e}, state {err_s:.2e} (relative "
            f"to the largest), conv state equal: {conv_same}")
        res.setdefault("numerics", []).append({"warps": w[0], "block_v": w[1], "o": err_o, "state": err_s,
                                               "conv_equal": conv_same})

    cases = [("recurrent", "xla", lambda: recurrent_program(None), state_bytes)]
    cases += [("recurrent", f"kernel-w{w}-bv{bv}", lambda w=w, bv=bv: recurrent_program((w, bv)), state_bytes)
              for w, bv in variants]
    cases += [("layer", "xla", lambda: layer_program(False), state_bytes + weight_bytes),
              ("layer", "kernel", lambda: layer_program(True), state_bytes + weight_bytes)]
    for scope, name, make, nbytes in cases:
        fn, fargs = make(), ()
        wall = wall_us(fn, fargs, args.reps) / L
        run = {"scope": scope, "variant": name, "wall_us_per_layer": wall, "bytes_per_layer": nbytes,
               "floor_us": nbytes / COPY_CEILING * 1e6}
        line = f"  {scope:9s} {name:16s}: wall {wall:8.2f} us/layer"
        if gpu:
            kus, n = trace_kernels(fn, fargs, max(2, args.reps // 4))
            run.update(kernel_us_per_layer=kus / L, kernels_per_layer=n / L,
                       fraction_of_hbm=nbytes / (kus / L * 1e-6) / COPY_CEILING)
            line += (f", GPU {kus / L:8.2f} us/layer in {n / L:.1f} kernels; {nbytes / 1e6:.2f} MB -> floor "
                     f"{run['floor_us']:.2f} us, {run['fraction_of_hbm']:.1%} of 4.2 TB/s")
        log(line)
        res["runs"].append(run)
    write_json(args.out, "gdn_kernel.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
