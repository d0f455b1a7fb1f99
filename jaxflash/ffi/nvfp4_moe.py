"""`expert_pairs`: a decode step's routed experts from NVFP4 weights by the FFI call jaxflash_nvfp4_moe.

On a GPU it runs two CUDA kernels (ffi/nvfp4_moe.cu), which XLA captures in the step's command buffer; on the
CPU its C++ handler (ffi/nvfp4_moe_cpu.cc) computes the same function with the same float16 arithmetic, for
tests. ffi/nvfp4_moe.h states the function and the arithmetic; jaxflash.kernels.nvfp4_experts chooses between
this route and the Pallas kernels, and jaxflash.model.moe.experts_gather is the pure-jnp twin of both.

The weights are described by nine parts (gate, up, down codes; their FP8 block scales; their float32 global
scales), each an operand index and a byte offset inside an expert's row of that operand: resident tensors
reshaped to [E, elements], or the cache's slot records uint8 [S, record_bytes].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext

MAX_TOKENS = 32  # decode batches and speculative verify rows (ffi/nvfp4_moe.h)
MAX_PAIRS = 512  # tokens x top-k


@dataclass(frozen=True)
class CudaTiles:
    """The CUDA kernels' block shapes (the CPU handler ignores them). lanes_*: threads per matrix row (a power of
    two up to 32; 0 picks the fewest that leave no thread idle, with at most 8 16-byte vectors per thread);
    threads_*: threads per block (at most 512; rounded down to whole rows); stages: row blocks each block has
    in flight (its shared-memory ring); blocks_*: blocks per pair (0: as many as make one wave of resident
    blocks); prefetch: the gate/up blocks pull their expert's down weights into L2 for the down kernel."""

    lanes_gu: int = 0
    lanes_down: int = 0
    threads_gu: int = 256
    threads_down: int = 256
    stages: int = 2
    blocks_gu: int = 0
    blocks_down: int = 0
    prefetch: bool = False


def available() -> bool:
    """Whether the loaded native module has the CUDA kernels and sees a GPU."""
    return bool(_ext.module().has_cuda) and _ext.module().cuda_device_count() > 0


def takes(hidden: int, inter: int, n_tok: int, top_k: int, dtype) -> bool:
    """Whether the call takes these shapes: bfloat16 tokens, H and I multiples of 32, up to MAX_TOKENS tokens and
    MAX_PAIRS (token, expert) pairs."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and hidden % 32 == 0 and inter % 32 == 0 and 1 <= n_tok <= MAX_TOKENS
            and n_tok * top_k <= MAX_PAIRS)


def parts_aligned(operands: tuple, part_arg, part_offset) -> bool:
    """Whether the codes and block scales (the first six parts) start 16-byte aligned in every expert's row, as
    the CUDA kernels' 16-byte copies need (XLA's buffers themselves are aligned)."""
    for a, off in zip(part_arg[:6], part_offset[:6]):
        op = operands[a]
        row = math.prod(op.shape[1:]) * jnp.dtype(op.dtype).itemsize
        if off % 16 or row % 16:
            return False
    return True


def expert_pairs(x: jax.Array, ids: jax.Array, operands: tuple, part_arg, part_offset, inter: int,
                 tiles: CudaTiles = CudaTiles()) -> jax.Array:
    """y [N, k, H] bfloat16: y[n, j] = down_e(bf16(silu(bf16(gate_e x_n)) * bf16(up_e x_n))) for e = ids[n, j],
    rounded to bfloat16 (an id outside the operands' rows gives zeros). x [N, H] bfloat16, ids [N, k] int32;
    part_arg / part_offset: the nine parts' operand indices and byte offsets."""
    n_tok, k = ids.shape
    hidden = x.shape[-1]
    if not takes(hidden, inter, n_tok, k, x.dtype):
        raise ValueError(f"nvfp4_moe takes bfloat16 tokens, H and I multiples of 32, 1..{MAX_TOKENS} tokens and at "
                         f"most {MAX_PAIRS} pairs; got x {x.dtype}{list(x.shape)}, ids {list(ids.shape)}, I={inter}")
    if len(part_arg) != 9 or len(part_offset) != 9:
        raise ValueError("nvfp4_moe needs nine parts (gate, up, down codes; their scales; their global scales)")
    if not parts_aligned(operands, part_arg, part_offset):
        raise ValueError("nvfp4_moe copies codes and block scales 16 bytes at a time: each part's offset and each "
                         "operand's expert row must be multiples of 16 bytes")
    _ext.module()
    pairs = n_tok * k
    call = jax.ffi.ffi_call("jaxflash_nvfp4_moe", (jax.ShapeDtypeStruct((pairs, hidden), jnp.bfloat16),
                                                   jax.ShapeDtypeStruct((pairs, inter), jnp.bfloat16)))
    y, _ = call(ids.astype(jnp.int32), x, *operands, part_arg=np.asarray(part_arg, np.int64),
                part_offset=np.asarray(part_offset, np.int64), lanes_gu=np.int64(tiles.lanes_gu),
                lanes_down=np.int64(tiles.lanes_down), threads_gu=np.int64(tiles.threads_gu),
                threads_down=np.int64(tiles.threads_down), stages=np.int64(tiles.stages),
                blocks_gu=np.int64(tiles.blocks_gu), blocks_down=np.int64(tiles.blocks_down),
                prefetch=np.int64(bool(tiles.prefetch)))
    return y.reshape(n_tok, k, hidden)
