#!/usr/bin/env python
"""Write a seeded random-weight qwen4_exp checkpoint in the real published layouts.

    python scripts/make_model.py --preset tiny --quant bf16 --seed 0 --out models/tiny-bf16
    python scripts/make_model.py --preset full --quant nvfp4 --seed 0 --out /data/full-nvfp4 --ngram-rows-scale 0.1

bf16: the BF16 release layout (text model + tiny vision tower + MTP). nvfp4: NVIDIA's ModelOpt MIXED_PRECISION
layout (NVFP4 routed experts, FP8 n-gram table, FP8 128-block MTP experts). The logic is jaxflash.synthetic.
"""

import argparse
import math
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxflash import synthetic  # noqa: E402
from jaxflash.checkpoint import DTYPES, expected_tensors  # noqa: E402
from jaxflash.presets import PRESETS  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--quant", required=True, choices=("bf16", "nvfp4"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--ngram-rows-scale", type=float, default=1.0,
                   help="shrink the n-gram table by this factor (0 < F <= 1) by scaling ngram_vocab_size_base; "
                        "the full table is 48 GiB in FP8, 96 GiB in BF16")
    p.add_argument("--layers", type=int, default=None,
                   help="keep the first N decoder layers (default: all of the preset's), e.g. so that a full-width "
                        "checkpoint fits a disk; each full-size layer holds 1.3 GiB of NVFP4 experts")
    p.add_argument("--tokenizer", action=argparse.BooleanOptionalAction, default=True,
                   help="write the synthetic tokenizer (tokenizer.json, chat template) and use its special-token ids "
                        "as eos, so the checkpoint can be served (default: yes; --no-tokenizer keeps the full "
                        "preset's published ids and writes none)")
    p.add_argument("--shard-size", type=float, default=4.0, help="maximum shard size in GiB (default 4)")
    p.add_argument("--threads", type=int, default=None, help="generator threads (default: CPU count, max 16)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)

    if os.path.isdir(a.out) and any(f.endswith(".safetensors") for f in os.listdir(a.out)):
        p.error(f"{a.out} already holds a checkpoint; choose an empty directory")
    try:
        config = synthetic.make_config(a.preset, ngram_rows_scale=a.ngram_rows_scale, num_layers=a.layers,
                                       tokenizer=a.tokenizer)
    except ValueError as e:
        p.error(str(e))
    quant = synthetic.release_quant_config(config) if a.quant == "nvfp4" else None
    size = sum(DTYPES[d].itemsize * math.prod(s) for s, d in expected_tensors(config, quant).values())
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(a.out)) or ".").free
    print(f"{a.preset}/{a.quant}: {size / 2**30:.2f} GiB of text-model weights -> {a.out}", file=sys.stderr)
    if size > free:
        p.error(f"needs {size / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB are free")
    t = time.time()
    synthetic.make_model(a.preset, a.quant, a.seed, a.out, ngram_rows_scale=a.ngram_rows_scale,
                         num_layers=a.layers, shard_size_gb=a.shard_size, threads=a.threads,
                         progress=False if a.quiet else None, tokenizer=a.tokenizer)
    print(f"done in {time.time() - t:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
