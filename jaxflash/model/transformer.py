"""The whole model (SPEC.md section 3): embedding, 48 decoder layers, final stream mixer, lm_head.

    h = [e, e, e, e]                                  # 4 residual streams [T, W]
    for each layer:  (PLE at layer 1)  h += inject * Mixer(mix(h));  h += inject * MoE(mix(h))
    logits = lm_head(final_mix(h))                    # no final norm: the mixer normalises

`forward` runs sequences from position 0 and is a pure function of (params, tokens): it works under jax.jit,
jax.vmap and jax.grad. Shapes: T tokens, W = hc_count * H.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from . import gated_deltanet as gdn
from . import hyper_connection as hc
from . import ple as ple_mod
from .attention import Attention, attention
from .base import Array, acc_dtype, precision_for, pytree_dataclass, up
from .moe import MoE, moe


@pytree_dataclass
class DecoderLayer:
    attn_hc: hc.HyperConnection
    mixer: gdn.GatedDeltaNet | Attention  # linear_attn or self_attn
    mlp_hc: hc.HyperConnection
    moe: MoE
    ple: ple_mod.PLE | None  # only on the PLE layer


@pytree_dataclass
class Params:
    embed: Array  # embed_tokens.weight [V, H]
    layers: tuple  # DecoderLayer per decoder layer
    mixer: hc.HyperConnection  # hyper_connection_mixer (no inject)
    lm_head: Array  # [V, H]
    mtp: object | None = None  # mtp.MTP, or None when the checkpoint has no MTP head

    @property
    def dtype(self):
        return self.embed.dtype


def embed(params: Params, cfg: ModelConfig, tokens: Array) -> Array:
    """The initial residual [..., T, W] float32: every stream starts as the token embedding."""
    e = up(params.embed[tokens])
    return jnp.concatenate([e] * cfg.hc_count, axis=-1)


def decoder_layer(layer: DecoderLayer, cfg: ModelConfig, h: Array, positions: Array, *,
                  ple_rows: Array | None = None, moe_impl: str = "auto", router_stats: list | None = None) -> Array:
    """One decoder layer over a batch of whole sequences from position 0 (fresh state). h [B, T, W].

    The mixers run per sequence (vmapped); the MoE runs over all B*T tokens at once.
    """
    dt = layer.moe.router.dtype
    s, eps = cfg.hc_count, cfg.rms_norm_eps
    b, t, _ = h.shape
    if layer.ple is not None:
        conv0 = ple_mod.init_state(cfg, h.dtype).conv
        out, _ = jax.vmap(lambda hh, rr: ple_mod.ple(layer.ple, cfg, hh, rr, conv0))(h, ple_rows)
        h = h + out

    x, inj = hc.mix(layer.attn_hc, h, s, eps)
    x = x.astype(dt)
    if isinstance(layer.mixer, Attention):
        y = jax.vmap(lambda xx: attention(layer.mixer, cfg, xx, positions))(x)
    else:
        state0 = gdn.init_state(cfg, dt)
        y = jax.vmap(lambda xx: gdn.gated_deltanet(layer.mixer, cfg, xx, state0)[0])(x)
    h = hc.combine(h, inj, y)

    x, inj = hc.mix(layer.mlp_hc, h, s, eps)
    y = moe(layer.moe, cfg, x.astype(dt).reshape(b * t, -1), impl=moe_impl,
            router_stats=router_stats).reshape(b, t, -1)
    return hc.combine(h, inj, y)


def lm_logits(params: Params, x: Array) -> Array:
    """float32 logits of the mixed hidden state x [..., H]."""
    x = x.astype(params.dtype)
    return jnp.einsum("...h,vh->...v", x, params.lm_head, precision=precision_for(x.dtype),
                      preferred_element_type=acc_dtype(x.dtype))


def ple_rows_for(params: Params, cfg: ModelConfig, tokens: Array, ngram_ids: Array | None) -> Array | None:
    """The n-gram rows [B, T, 16, d] of sequences from a device-resident table (hashing the tokens on the host
    when ids are not given)."""
    ple_layer = next((l.ple for l in params.layers if l.ple is not None), None)
    if ple_layer is None:
        return None
    if ple_layer.table is None:
        raise ValueError("this model's n-gram table is on the host: pass ple_rows (jaxflash.Engine does)")
    if ngram_ids is None:
        context = jnp.full(tokens.shape[:-1] + (cfg.ngram_size - 1,), cfg.eos_token_id, jnp.int32)
        ngram_ids = ple_mod.ngram_ids_traced(cfg, tokens, context)
    return ple_mod.gather_rows(ple_layer, ngram_ids)


def _batched(tokens: Array, *extra):
    """Add a batch axis to a single sequence (and to its per-token extras)."""
    if tokens.ndim == 1:
        return True, tokens[None], *(None if a is None else a[None] for a in extra)
    return False, tokens, *extra


def forward_hidden(params: Params, cfg: ModelConfig, tokens: Array, *, ple_rows: Array | None = None,
                   ngram_ids: Array | None = None, moe_impl: str = "auto", router_stats: list | None = None) -> Array:
    """The multi-stream residual after the last layer, before the final mixer: [..., T, W] float32.
    router_stats: a list that collects each layer's (router probabilities, expert ids) (see moe.moe)."""
    single, tokens, ple_rows, ngram_ids = _batched(tokens, ple_rows, ngram_ids)
    positions = jnp.arange(tokens.shape[-1])
    if ple_rows is None:
        ple_rows = ple_rows_for(params, cfg, tokens, ngram_ids)
    h = embed(params, cfg, tokens)
    for layer in params.layers:
        h = decoder_layer(layer, cfg, h, positions, ple_rows=ple_rows, moe_impl=moe_impl, router_stats=router_stats)
    return h[0] if single else h


def forward(params: Params, cfg: ModelConfig, tokens: Array, *, ple_rows: Array | None = None,
            ngram_ids: Array | None = None, moe_impl: str = "auto") -> Array:
    """Logits [..., T, V] float32 of one sequence tokens [T] or a batch [B, T] (right-padded: every layer is
    causal, so padding at the end never changes the logits of the real tokens).

    The PLE n-gram rows come from `ple_rows` [..., T, 16, d] (a host-resident table), or are gathered from the
    device table using `ngram_ids` [..., T, 16], or hashed from the tokens when neither is given.
    moe_impl: "gather", "ragged" or "auto"; under an outer jax.vmap use "gather".
    """
    h = forward_hidden(params, cfg, tokens, ple_rows=ple_rows, ngram_ids=ngram_ids, moe_impl=moe_impl)
    x, _ = hc.mix(params.mixer, h, cfg.hc_count, cfg.rms_norm_eps)
    return lm_logits(params, x)
