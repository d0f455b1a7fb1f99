"""Checkpoint tensors -> the model's parameter pytree, one decoder layer at a time.

`source` is anything with `has(name)` and `read(name) -> np.ndarray`, where names are the checkpoint's without
the text prefix ("layers.3.self_attn.q_proj.weight", "embed_tokens.weight"); "lm_head.*" and "mtp.*" are
top-level names. jaxflash.checkpoint.Checkpoint is one; a dict of arrays wrapped in `DictSource` is another.
Each layer is converted and put on the device before the next is read, so host memory holds one layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..config import FULL_ATTENTION, ModelConfig
from . import gated_deltanet as gdn
from . import hyper_connection as hc
from . import ple as ple_mod
from .base import stack_rows
from .attention import Attention
from .moe import NVFP4, Experts, FP8Block, MoE
from .mtp import MTP
from .qsa import Indexer
from .transformer import DecoderLayer, Params

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


class DictSource:
    """A tensor source over an in-memory {name: array} dict."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors

    def has(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise KeyError(f"tensor {name!r} is missing")
        return np.asarray(self.tensors[name])


class _Reader:
    """Reads named tensors from a source and converts them to device arrays of the compute dtype."""

    def __init__(self, source, dtype, on_read: Callable[[str], None] | None = None):
        self.source, self.dtype, self.on_read = source, jnp.dtype(dtype), on_read

    def raw(self, name: str) -> np.ndarray:
        a = self.source.read(name)
        if self.on_read:
            self.on_read(name)
        return a

    def __call__(self, name: str, squeeze_middle: bool = False) -> np.ndarray:
        a = self.raw(name)
        if squeeze_middle:  # conv1d.weight [C, 1, K] -> [C, K]
            a = a.reshape(a.shape[0], a.shape[-1])
        return np.asarray(a, dtype=self.dtype)


def _hyper_connection(r: _Reader, prefix: str, inject: bool) -> hc.HyperConnection:
    return hc.HyperConnection(
        norm=r(f"{prefix}.hc_norm.weight"),
        down=r(f"{prefix}.input_mix_weight_down.weight"),
        up=r(f"{prefix}.input_mix_weight_up.weight"),
        inject=r(f"{prefix}.block_inject_weight.weight") if inject else None,
    )


def _gdn(r: _Reader, p: str) -> gdn.GatedDeltaNet:
    return gdn.GatedDeltaNet(
        in_proj=stack_rows(r(f"{p}.in_proj_qkv.weight"), r(f"{p}.in_proj_z.weight"), r(f"{p}.in_proj_b.weight"),
                           r(f"{p}.in_proj_a.weight")),
        conv1d=r(f"{p}.conv1d.weight", squeeze_middle=True), dt_bias=r(f"{p}.dt_bias"), A_log=r(f"{p}.A_log"),
        norm=r(f"{p}.norm.weight"), out_proj=r(f"{p}.out_proj.weight"),
    )


def _attention(r: _Reader, cfg: ModelConfig, p: str) -> Attention:
    indexer = None
    if cfg.qsa_enabled:
        indexer = Indexer(index_qk_proj=r(f"{p}.indexer.index_qk_proj.weight"),
                          q_norm=r(f"{p}.indexer.q_layernorm.weight"), k_norm=r(f"{p}.indexer.k_layernorm.weight"))
    return Attention(
        qkv_proj=stack_rows(r(f"{p}.q_proj.weight"), r(f"{p}.k_proj.weight"), r(f"{p}.v_proj.weight")),
        o_proj=r(f"{p}.o_proj.weight"), q_norm=r(f"{p}.q_norm.weight"), k_norm=r(f"{p}.k_norm.weight"),
        indexer=indexer,
    )


def _expert_stack(r: _Reader, p: str, proj: str, n: int) -> np.ndarray | NVFP4 | FP8Block:
    """All experts' `proj` as one stack: NVFP4 kept packed, FP8 128-block kept as FP8 with its scales, dense
    cast."""
    names = [f"{p}.experts.{e}.{proj}" for e in range(n)]
    src = r.source
    if src.has(f"{names[0]}.weight_scale_2"):  # NVFP4
        return NVFP4(
            packed=np.stack([r.raw(f"{nm}.weight") for nm in names]),
            scale=np.stack([r.raw(f"{nm}.weight_scale") for nm in names]).astype(FP8),
            scale2=np.stack([np.asarray(r.raw(f"{nm}.weight_scale_2"), np.float32).reshape(()) for nm in names]),
        )
    first = r.raw(f"{names[0]}.weight")
    if first.dtype == FP8:  # FP8 128x128-block weights (the MTP experts of the NVFP4 checkpoint)
        # `weight_scale_inv` (DeepSeek's name) is, despite the name, the same multiplier as weight_scale
        scales = [f"{nm}.weight_scale" if src.has(f"{nm}.weight_scale") else f"{nm}.weight_scale_inv"
                  for nm in names]
        return FP8Block(q=np.stack([first] + [r.raw(f"{nm}.weight") for nm in names[1:]]),
                        scale=np.stack([np.asarray(r.raw(nm), np.float32) for nm in scales]))
    out = np.empty((n, *first.shape), r.dtype)
    for e, nm in enumerate(names):
        out[e] = first if e == 0 else r.raw(f"{nm}.weight")
    return out


def _moe(r: _Reader, cfg: ModelConfig, p: str, routed: bool = True) -> MoE:
    n = cfg.num_experts
    experts = None
    if routed:
        experts = Experts(gate=_expert_stack(r, p, "gate_proj", n), up=_expert_stack(r, p, "up_proj", n),
                          down=_expert_stack(r, p, "down_proj", n))
    inputs = stack_rows(r(f"{p}.gate.weight"), r(f"{p}.shared_expert.gate_proj.weight"),
                        r(f"{p}.shared_expert.up_proj.weight"), r(f"{p}.shared_expert_gate.weight"))
    return MoE(inputs=inputs, experts=experts, shared_down_proj=r(f"{p}.shared_expert.down_proj.weight"))


def _ple(r: _Reader, cfg: ModelConfig, p: str, table) -> ple_mod.PLE:
    """table: (rows array, scale or None) to keep the n-gram table on the device, or None for the host."""
    rows, scale = table if table is not None else (None, None)
    return ple_mod.PLE(
        key_proj=r(f"{p}.key_proj.weight"), value_proj=r(f"{p}.value_proj.weight"),
        norm_key=r(f"{p}.norm_key.weight"), norm_query=r(f"{p}.norm_query.weight"),
        norm_conv=r(f"{p}.norm_conv.weight"), conv1d=r(f"{p}.conv1d.weight", squeeze_middle=True),
        table=rows, table_scale=None if scale is None else np.float32(scale),
    )


def _decoder_layer(r: _Reader, cfg: ModelConfig, p: str, attention: bool, ple_table=None,
                   has_ple: bool = False, routed: bool = True) -> DecoderLayer:
    mixer = _attention(r, cfg, f"{p}.self_attn") if attention else _gdn(r, f"{p}.linear_attn")
    return DecoderLayer(
        attn_hc=_hyper_connection(r, f"{p}.attn_hyper_connection", inject=True),
        mixer=mixer,
        mlp_hc=_hyper_connection(r, f"{p}.mlp_hyper_connection", inject=True),
        moe=_moe(r, cfg, f"{p}.mlp", routed),
        ple=_ple(r, cfg, f"{p}.ple", ple_table) if has_ple else None,
    )


def load_params(source, cfg: ModelConfig, dtype="float32", *, ple_table=None, device=None,
                with_mtp: bool = True, layers: Iterable[int] | None = None, routed_experts: bool = True,
                on_read: Callable[[str], None] | None = None) -> Params:
    """Build Params from a tensor source, putting each layer on `device` (default: JAX's default device) as
    soon as it is read.

    ple_table: (rows, scale) for a device-resident n-gram table (rows [N, d] as stored: fp8/bf16/f32; scale the
    global FP8 scale or None), or None to leave the table on the host (Engine gathers rows per step).
    routed_experts=False leaves the decoder layers' routed experts out (experts=None): the engine keeps them in
    a host pool instead; the MTP layer's experts are always loaded with the head (with_mtp=False: no head).
    """
    r = _Reader(source, dtype, on_read)
    put = (lambda tree: jax.device_put(tree, device))
    layer_ids = range(cfg.num_hidden_layers) if layers is None else layers
    if ple_table is not None:
        rows, scale = ple_table
        rows = np.asarray(rows)
        if rows.dtype != FP8:
            rows = rows.astype(r.dtype)
        ple_table = (rows, scale)

    built = []
    for i in layer_ids:
        built.append(put(_decoder_layer(r, cfg, f"layers.{i}", cfg.layer_types[i] == FULL_ATTENTION,
                                        ple_table, has_ple=i in cfg.ple_layers, routed=routed_experts)))
    mtp = None
    if with_mtp and cfg.mtp_num_hidden_layers and source.has("mtp.fc_hidden.weight"):
        mtp = put(MTP(
            pre_fc_norm_embedding=r("mtp.pre_fc_norm_embedding.weight"),
            pre_fc_norm_hidden=r("mtp.pre_fc_norm_hidden.weight"),
            fc_embedding=r("mtp.fc_embedding.weight"), fc_hidden=r("mtp.fc_hidden.weight"),
            layer=_decoder_layer(r, cfg, "mtp.layers.0", attention=True),
            mixer=_hyper_connection(r, "mtp.hyper_connection_mixer", inject=False),
        ))
    return Params(
        embed=put(r("embed_tokens.weight")),
        layers=tuple(built),
        mixer=put(_hyper_connection(r, "hyper_connection_mixer", inject=False)),
        lm_head=put(r("lm_head.weight")),
        mtp=mtp,
    )
