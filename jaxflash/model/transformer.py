"""The whole model (docs/model.md §3): embedding, the decoder layers, final stream mixer, lm_head.

    h = [e, e, e, e]                                  # 4 residual streams [B, T, W]
    for each layer:  (PLE at its layer)  h += inject * Mixer(mix(h));  h += inject * MoE(mix(h))
    logits = lm_head(final_mix(h))                    # no final norm: the mixer normalises

A layer returns its MoE output beside h rather than added to it: the next layer adds it where its first mix
reads h (hyper_connection.combine_mix: inside the mix's kernel at decode, no kernel of its own), and the caller
after the last layer (`finish`).

One function, `decoder_layer`, is the layer for every caller. It runs new tokens of B sequences on top of each
sequence's state (paged KV for attention, conv + recurrent state for GDN, the conv state of PLE) and returns
the updated state: the engine's prefill chunks and decode steps pass the state they keep, the full-sequence
`forward` passes a fresh one (nothing cached, every token new). `forward` is a pure function of (params,
tokens) and works under jax.jit, jax.vmap and jax.grad. Shapes: T tokens, H hidden, W = hc_count * H.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from . import gated_deltanet as gdn
from . import hyper_connection as hc
from . import ple as ple_mod
from .attention import Attention, PagedKV, attention
from .base import Array, TokenBatch, acc_dtype, precision_for, pytree_dataclass, up
from .moe import MoE, ResidentExperts, Routing, moe_parts


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


@pytree_dataclass
class LayerState:
    """What one decoder layer keeps between calls for a batch of sequences."""

    mixer: gdn.GDNState | PagedKV  # GDN: conv [B, K-1, C] + recurrent [B, Hv, dk, dv]; attention: shared pages
    ple_conv: Array | None = None  # PLE layer only: [B, (K-1)*dilation, W] float32


def init_layer_state(layer: DecoderLayer, cfg: ModelConfig, batch: int, dtype, num_pages: int,
                     page_size: int) -> LayerState:
    """An empty state for `batch` sequences (attention: `num_pages` pages of `page_size` rows, shared)."""
    if isinstance(layer.mixer, Attention):
        mixer = PagedKV.empty(cfg, num_pages, page_size, dtype, layer.mixer.indexer is not None)
    else:
        mixer = jax.tree.map(lambda a: jnp.zeros((batch,) + a.shape, a.dtype), gdn.init_state(cfg, dtype))
    ple_conv = None
    if layer.ple is not None:
        ple_conv = jnp.zeros((batch, cfg.ple_conv_state_len, cfg.hc_hidden_size), acc_dtype(dtype))
    return LayerState(mixer, ple_conv)


def embed(params: Params, cfg: ModelConfig, tokens: Array) -> Array:
    """The initial residual [..., T, W] float32: every stream starts as the token embedding."""
    e = up(params.embed[tokens])
    return jnp.concatenate([e] * cfg.hc_count, axis=-1)


def decoder_layer(layer: DecoderLayer, cfg: ModelConfig, index: int, h: Array, batch: TokenBatch,
                  state: LayerState, experts, ple_rows: Array | None = None, expert_ids: Array | None = None,
                  gdn_kernel: bool = False, hc_kernel: bool = False, pending: bool = False,
                  attn_kernel: bool = False, moe_in: tuple | None = None):
    """Decoder layer `index` over the new tokens h [B, T, W] (float32 residual) of `batch`, on top of `state`.

    experts: the routed experts' source (moe.ResidentExperts, or the engine's host-pool sources).
    ple_rows [B, T, 16, d]: the n-gram rows of the new tokens (PLE layer only).
    expert_ids [B*T, k]: fixed routing instead of the router's top-k (see moe.moe).
    gdn_kernel: decode steps and prefill chunks run the GDN recurrent part in kernels (gated_deltanet's
    `kernel`); hc_kernel: the hyper-connection mixes of a few rows run in theirs (hyper_connection.mix's
    `kernel`); attn_kernel: decode and verify steps attend in theirs (attention's `kernel`).
    pending: a verify step: the GDN and PLE parts of the returned LayerState are pending (GDNPendingBatch, the PLE
    conv history) until `commit_layers` keeps each sequence's accepted tokens; the KV pages are written for
    every new token (positions past a sequence's length are never read, and later tokens overwrite them).
    moe_in: the previous layer's moe_out, added to h here first.
    Returns (h [B, T, W], moe_out, the updated LayerState, the updated expert source, Routing of the B*T
    tokens); moe_out = (inj [B, T, S], moe.MoEOutput [B, T, H]) is this layer's MoE block's output and its
    injection weights, not yet added to h: the residual after the layer is `finish(h, moe_out)`.
    The mixers run per sequence; the MoE runs over all B*T tokens at once. Padding tokens leave every state
    as it was.
    """
    dt = layer.moe.inputs.dtype
    s, eps = cfg.hc_count, cfg.rms_norm_eps
    b, t, _ = h.shape
    n_new = batch.n_new
    ple_conv = state.ple_conv
    if layer.ple is not None:
        if moe_in is not None:  # PLE reads h: the previous MoE output goes in first
            h, moe_in = finish(h, moe_in), None
        with jax.named_scope("ple"):
            out, ple_conv = jax.vmap(lambda hh, rr, cs, n: ple_mod.ple(layer.ple, cfg, hh, rr, cs, n, pending))(
                h, ple_rows, ple_conv, n_new)
            h = h + out

    is_attention = isinstance(layer.mixer, Attention)
    with jax.named_scope("attention" if is_attention else "gdn"):
        with jax.named_scope("hyper_connection"):
            if moe_in is None:
                x, inj = hc.mix(layer.attn_hc, h, s, eps, hc_kernel, dt)
            else:
                h, x, inj = hc.combine_mix(layer.attn_hc, h, *moe_in, s, eps, hc_kernel, dt)
        if is_attention:
            y, mixer = attention(layer.mixer, cfg, x, batch, state.mixer, attn_kernel)
        else:
            y, mixer = gdn.gated_deltanet_batch(layer.mixer, cfg, x, state.mixer, n_new, gdn_kernel, pending)

    with jax.named_scope("moe"):
        with jax.named_scope("hyper_connection"):  # the mixer's combine with the MoE's mix
            h, x, inj = hc.combine_mix(layer.mlp_hc, h, inj, y, s, eps, hc_kernel, dt)
        y, experts, routing = moe_parts(layer.moe, cfg, x.reshape(b * t, -1), experts, index,
                                        batch.valid.reshape(-1), expert_ids)
    moe_out = (inj, jax.tree.map(lambda a: a.reshape(b, t, -1), y))
    return h, moe_out, LayerState(mixer, ple_conv), experts, routing


def finish(h: Array, moe_out: tuple) -> Array:
    """The residual after a layer: its h with its moe_out added (hyper_connection.combine)."""
    with jax.named_scope("hyper_connection"):
        return hc.combine(h, *moe_out)


def forward_layers(params: Params, cfg: ModelConfig, tokens: Array, batch: TokenBatch, states: tuple, experts,
                   ple_rows: Array | None, expert_ids: Array | None = None, gdn_kernel: bool = False,
                   hc_kernel: bool = False, pending: bool = False, attn_kernel: bool = False):
    """Embedding and every decoder layer over the new tokens [B, T] of `batch`.
    states: a LayerState per decoder layer; expert_ids [L, B*T, k]: fixed routing per layer (None: the
    routers'); gdn_kernel, hc_kernel, pending, attn_kernel: see decoder_layer. Returns (h [B, T, W] before the final mixer,
    the updated states, the updated expert source, a Routing per layer)."""
    h = embed(params, cfg, tokens)
    new_states, routings, moe_out = [], [], None
    for i, layer in enumerate(params.layers):
        with jax.named_scope(f"layer_{i}"):
            h, moe_out, st, experts, r = decoder_layer(layer, cfg, i, h, batch, states[i], experts,
                                                       ple_rows if layer.ple is not None else None,
                                                       None if expert_ids is None else expert_ids[i], gdn_kernel,
                                                       hc_kernel, pending, attn_kernel, moe_in=moe_out)
        new_states.append(st)
        routings.append(r)
    if moe_out is not None:
        with jax.named_scope(f"layer_{len(params.layers) - 1}"), jax.named_scope("moe"):
            h = finish(h, moe_out)
    return h, tuple(new_states), experts, tuple(routings)


def commit_layers(cfg: ModelConfig, states: tuple, keep: Array) -> tuple:
    """The layer states after the first keep[b] new tokens of each sequence b (0: as before the step), from a
    verify step's pending states (forward_layers(pending=True)): exactly the states that feeding those tokens
    alone gives."""
    out = []
    for st in states:
        mixer = st.mixer
        if isinstance(mixer, gdn.GDNPendingBatch):
            mixer = gdn.commit_batch(mixer, keep)
        ple_conv = st.ple_conv
        if ple_conv is not None:
            ple_conv = jax.vmap(lambda hist, n: ple_mod.commit(hist, cfg, n))(ple_conv, keep)
        out.append(LayerState(mixer, ple_conv))
    return tuple(out)


def fresh(cfg: ModelConfig, layers, batch: int, length: int, dtype) -> tuple[TokenBatch, tuple]:
    """The batch and states of a full-sequence forward: `batch` sequences of `length` new tokens from position
    0, nothing cached; each sequence's attention cache is one page of `length` rows."""
    tb = TokenBatch.after(jnp.zeros(batch, jnp.int32), jnp.full(batch, length, jnp.int32), length,
                          jnp.arange(batch, dtype=jnp.int32)[:, None])
    return tb, tuple(init_layer_state(l, cfg, batch, dtype, batch, length) for l in layers)


def lm_logits(params: Params, x: Array) -> Array:
    """float32 logits of the mixed hidden state x [..., H]."""
    x = x.astype(params.dtype)
    return jnp.einsum("...h,vh->...v", x, params.lm_head, precision=precision_for(x.dtype),
                      preferred_element_type=acc_dtype(x.dtype))


def final_logits(params: Params, cfg: ModelConfig, h: Array, hc_kernel: bool = False) -> Array:
    """Logits [..., V] of the multi-stream state h [..., W]: the final stream mixer, then lm_head."""
    with jax.named_scope("lm_head"):
        x, _ = hc.mix(params.mixer, h, cfg.hc_count, cfg.rms_norm_eps, hc_kernel, params.dtype)
        return lm_logits(params, x)


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
                   ngram_ids: Array | None = None, moe_impl: str = "auto", return_routing: bool = False):
    """The multi-stream residual after the last layer, before the final mixer: [..., T, W] float32.
    With return_routing, returns (that, a Routing per layer) -- the router's choices, for training losses."""
    single, tokens, ple_rows, ngram_ids = _batched(tokens, ple_rows, ngram_ids)
    if ple_rows is None:
        ple_rows = ple_rows_for(params, cfg, tokens, ngram_ids)
    batch, states = fresh(cfg, params.layers, tokens.shape[0], tokens.shape[1], params.dtype)
    h, _, _, routing = forward_layers(params, cfg, tokens, batch, states, ResidentExperts(moe_impl), ple_rows)
    h = h[0] if single else h
    return (h, routing) if return_routing else h


def forward(params: Params, cfg: ModelConfig, tokens: Array, *, ple_rows: Array | None = None,
            ngram_ids: Array | None = None, moe_impl: str = "auto") -> Array:
    """Logits [..., T, V] float32 of one sequence tokens [T] or a batch [B, T] (right-padded: every layer is
    causal, so padding at the end never changes the logits of the real tokens).

    The PLE n-gram rows come from `ple_rows` [..., T, 16, d] (a host-resident table), or are gathered from the
    device table using `ngram_ids` [..., T, 16], or hashed from the tokens when neither is given.
    moe_impl: "gather", "tiled", "ragged" or "auto"; under an outer jax.vmap use "gather" or "tiled".
    """
    h = forward_hidden(params, cfg, tokens, ple_rows=ple_rows, ngram_ids=ngram_ids, moe_impl=moe_impl)
    return final_logits(params, cfg, h)


__all__ = ["DecoderLayer", "LayerState", "Params", "Routing", "TokenBatch", "decoder_layer", "embed",
           "final_logits", "finish", "forward", "forward_hidden", "forward_layers", "fresh", "init_layer_state",
           "lm_logits"]
