#!/usr/bin/env python3
"""One layer of routed experts on full-size shapes, each route called a few times: a program small enough to run
under a kernel profiler, e.g. on the H200

    ncu --clock-control none --kernel-name regex:nvfp4 --launch-count 8 --section SpeedOfLight \\
        --section LaunchStats --section Occupancy --section WarpStateStats python3 benchmarks/expert_once.py

which profiles the CUDA route's two kernels (nvfp4_moe_gate_up, nvfp4_moe_down) and the Pallas route's
(nvfp4_gate_up, nvfp4_down), in that order, for the same tokens and experts.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--routes", default="cuda,pallas")
    ap.add_argument("--calls", type=int, default=2, help="calls per route")
    ap.add_argument("--preset", default="full", choices=["full", "tiny"])
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from expert_kernel import random_experts
    from jaxflash.kernels import nvfp4_experts as K

    e, h, i, k = (512, 2560, 640, 10) if args.preset == "full" else (16, 64, 32, 4)
    ex = random_experts(jax.random.key(0), e, h, i)
    place, ops = K.resident_operands(ex)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(args.tokens)]), jnp.int32)
    x = jnp.asarray(rng.normal(size=(args.tokens, h)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(size=(args.tokens, k)) / k, jnp.bfloat16)
    for route in args.routes.split(","):
        fn = jax.jit(lambda ops, x, ids, w, route=route: K.routed_experts(place, ops, x, ids, w, route=route))
        for _ in range(args.calls):
            out = fn(ops, x, ids, w).block_until_ready()
        print(f"{route}: {args.tokens} token(s), output norm {float(jnp.linalg.norm(out)):.4g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
