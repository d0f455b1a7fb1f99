"""The MTP head (docs/model.md §11): from the main model's multi-stream state at position t and the token at t+1,
predict the token at t+2. vLLM/SGLang semantics (transformers has no MTP).

    e   = fc_embedding(norm_H(embed(tok[t+1])))
    x0  = fc_hidden(norm_W(hm)[stream s]) + e           for every stream s   (norm_W: one RMSNorm over all W)
    hm' = one full-attention decoder layer (x0)
    logits = lm_head(mtp_mixer(hm'));  hm' feeds the next draft step
"""

from __future__ import annotations

import jax

from ..config import ModelConfig
from . import hyper_connection as hc
from .base import Array, TokenBatch, linear, pytree_dataclass, up
from .moe import ResidentExperts
from .norms import rms_norm
from .transformer import DecoderLayer, LayerState, Params, decoder_layer, finish, fresh, lm_logits


@pytree_dataclass
class MTP:
    pre_fc_norm_embedding: Array  # [H]
    pre_fc_norm_hidden: Array  # [W]
    fc_embedding: Array  # [H, H]
    fc_hidden: Array  # [H, H], shared by the streams
    layer: DecoderLayer  # mtp.layers.0: full attention + QSA, MoE, hyper-connections; no PLE
    mixer: hc.HyperConnection  # mtp.hyper_connection_mixer (its inject weight is unused)


def mtp_input(params: Params, cfg: ModelConfig, hidden: Array, next_tokens: Array) -> Array:
    """The MTP layer's input x0 [B, T, W] from the main state hidden [B, T, W] and the next tokens [B, T]."""
    m: MTP = params.mtp
    dt = params.dtype
    s, hid, eps = cfg.hc_count, cfg.hidden_size, cfg.rms_norm_eps
    b, t, _ = hidden.shape
    e = linear(rms_norm(params.embed[next_tokens].astype(dt), m.pre_fc_norm_embedding, eps), m.fc_embedding)
    hn = rms_norm(hidden, m.pre_fc_norm_hidden, eps).astype(dt).reshape(b, t, s, hid)
    x0 = up(linear(hn, m.fc_hidden)) + up(e)[:, :, None, :]
    return x0.reshape(b, t, s * hid)


def mtp_logits(params: Params, cfg: ModelConfig, h: Array) -> Array:
    """Draft logits from the MTP layer's output state h [..., W]."""
    with jax.named_scope("mtp_head"):
        x, _ = hc.mix(params.mtp.mixer, h, cfg.hc_count, cfg.rms_norm_eps)
        return lm_logits(params, x)


def mtp_layer(params: Params, cfg: ModelConfig, hidden: Array, next_tokens: Array, batch: TokenBatch,
              state: LayerState, experts=ResidentExperts()):
    """The MTP layer over new (state, token) pairs of `batch`: hidden [B, T, W] the main model's pre-mixer state
    at positions t, next_tokens [B, T] the tokens at t+1; `state` is the layer's own KV cache. Returns (its
    output state hm' [B, T, W], the updated LayerState, Routing)."""
    with jax.named_scope("mtp"):
        x0 = mtp_input(params, cfg, hidden, next_tokens)
        h, moe_out, state, _, routing = decoder_layer(params.mtp.layer, cfg, 0, x0, batch, state, experts)
        h = finish(h, moe_out)
    return h, state, routing


def mtp_forward(params: Params, cfg: ModelConfig, hidden: Array, next_tokens: Array,
                moe_impl: str = "auto", return_routing: bool = False):
    """hidden [..., T, W]: the main model's pre-mixer state at positions 0..T-1; next_tokens [..., T]: the
    tokens at positions 1..T. Returns (draft logits [..., T, V] for the tokens at positions 2..T+1, the MTP
    layer's output state [..., T, W]), and the layer's Routing when return_routing. A fresh KV cache: the
    pairs of positions 0..T-1 are all new."""
    single = hidden.ndim == 2
    if single:
        hidden, next_tokens = hidden[None], next_tokens[None]
    batch, (state,) = fresh(cfg, (params.mtp.layer,), hidden.shape[0], hidden.shape[1], params.dtype)
    h, _, routing = mtp_layer(params, cfg, hidden, next_tokens, batch, state, ResidentExperts(moe_impl))
    logits = mtp_logits(params, cfg, h)
    out = (logits[0], h[0]) if single else (logits, h)
    return (*out, routing) if return_routing else out
