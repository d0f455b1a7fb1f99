"""The numerical reference: transformers' qwen4_exp on tiny random configs, run in float64 on the CPU.

Every parameter is randomised (norm weights included, with scales that keep activations O(1)), so a test
fails if any weight is ignored or misplaced.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

torch.set_grad_enabled(False)


def tiny_hf_config(**overrides) -> Qwen4ExpTextConfig:
    kw = dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, hc_count=4, hc_lowrank=8, ple_layer_ids=[2], ple_embed_dim=32,
        ngram_vocab_size_base=200, split_ngram_parts=4, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        eos_token_id=3, output_gate_type="sigmoid", max_position_embeddings=4096,
    )
    kw.update(overrides)
    return Qwen4ExpTextConfig(**kw)


def _std(name: str, shape) -> tuple[float, float]:
    """(mean, std) for a parameter, by its role."""
    if name.endswith(("norm.weight", "hc_norm.weight", "norm_key.weight", "norm_query.weight",
                      "norm_conv.weight", "layernorm.weight")):
        if "linear_attn.norm" in name:  # RMSNormGated multiplies by w directly
            return 1.0, 0.2
        return 0.0, 0.2  # (1 + w) norms
    if name.endswith("A_log"):
        return math.log(2.0), 0.5
    if name.endswith("dt_bias"):
        return 0.0, 0.5
    if "conv1d" in name:
        return 0.0, 0.4
    if "ngram_embedding" in name:
        return 0.0, 1.0
    if name.endswith("embed_tokens.weight"):
        return 0.0, 1.0
    if name.endswith("mlp.gate.weight"):  # router: spread the logits so top-k is well separated
        return 0.0, 2.0 / math.sqrt(shape[-1])
    fan_in = shape[-1]
    return 0.0, 1.0 / math.sqrt(fan_in)


def build_hf_model(cfg: Qwen4ExpTextConfig, seed: int = 0) -> Qwen4ExpForCausalLM:
    torch.manual_seed(seed)
    cfg._experts_implementation = "eager"  # the grouped-mm path has no float64 kernel
    model = Qwen4ExpForCausalLM(cfg).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        mean, std = _std(name, tuple(p.shape))
        # float32-representable values: a float32 checkpoint of the model holds exactly these weights
        p.copy_((mean + std * torch.randn(p.shape, generator=gen, dtype=torch.float64)).float())
    return model


def save_checkpoint(model: Qwen4ExpForCausalLM, directory, dtype=torch.float32) -> None:
    """save_pretrained in `dtype` (transformers' text-only layout), leaving the float64 model as it was."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(dtype).save_pretrained(directory)
    model.to(torch.float64).load_state_dict(state)


def round_to(model: Qwen4ExpForCausalLM, dtype) -> None:
    """Round every parameter to `dtype` in place (stays float64): the reference for a checkpoint in `dtype`."""
    for p in model.parameters():
        p.copy_(p.to(dtype).double())

def hf_logits(model: Qwen4ExpForCausalLM, tokens) -> np.ndarray:
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)[None]
    return model(input_ids=ids).logits[0].double().numpy()


def checkpoint_tensors(model: Qwen4ExpForCausalLM) -> dict[str, np.ndarray]:
    """The model's tensors under checkpoint names (per-expert projections, sharded n-gram table), without the
    `model.` prefix, as save_pretrained would write them."""
    return checkpoint_tensors_of(model.state_dict(), model.config)


def checkpoint_tensors_of(state: dict, cfg) -> dict[str, np.ndarray]:
    out = {}
    for name, t in state.items():
        a = t.numpy()
        name = name.removeprefix("model.")
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            inter = a.shape[1] // 2
            for e in range(a.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = a[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = a[e, inter:]
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(a.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = a[e]
        elif name.endswith("ngram_embedding.weight"):
            base = name.removesuffix("weight")
            for i, shard in enumerate(np.split(a, cfg.split_ngram_parts)):
                out[f"{base}shard_{i}.weight"] = shard
        else:
            out[name] = a
    return out


def pre_mixer_hidden(model: Qwen4ExpForCausalLM, tokens) -> np.ndarray:
    """The multi-stream residual entering the final hyper_connection_mixer [T, W] (what MTP reads)."""
    seen = {}
    hook = model.model.hyper_connection_mixer.register_forward_pre_hook(
        lambda m, args: seen.setdefault("h", args[0].detach().clone()))
    try:
        hf_logits(model, tokens)
    finally:
        hook.remove()
    return seen["h"][0].numpy()


def near_ties(model: Qwen4ExpForCausalLM, tokens, tol: float = 1e-6) -> int:
    """How many discrete choices of the reference run on `tokens` sit within `tol` of flipping: an expert at the
    top-k boundary of a router (probability gap), or a QSA block at the top-k boundary of a query's block
    scores (relative gap). There, float32 rounding can legitimately pick the other side (and torch.topk breaks
    exact ties arbitrarily), so logits are not comparable; tests assert this count is zero for their inputs.
    Recomputes the QSA scores in float64 from the indexer's own submodules."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    cfg = model.config
    inputs = {}

    def grab(i):
        def hook(module, args, kwargs):
            named = dict(zip(("hidden_states", "position_embeddings"), args)) | kwargs
            inputs.setdefault(i, (named["hidden_states"], named["position_embeddings"]))
        return hook

    hooks = [layer.self_attn.register_forward_pre_hook(grab(i), with_kwargs=True)
             for i, layer in enumerate(model.model.layers) if hasattr(layer, "self_attn")]
    try:
        ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)[None]
        router_logits = model(input_ids=ids, output_router_logits=True).router_logits
    finally:
        for h in hooks:
            h.remove()

    k = cfg.num_experts_per_tok
    ties = 0
    for logits in router_logits:
        if k < cfg.num_experts:
            top = torch.sort(torch.softmax(logits.double(), -1), -1, descending=True).values
            ties += int((top[:, k - 1] - top[:, k] <= tol).sum())

    r, k_top = cfg.indexer_compress_ratio, cfg.indexer_budget // cfg.indexer_compress_ratio
    for i, (x, (cos, sin)) in inputs.items():
        ix = model.model.layers[i].self_attn.indexer
        t = x.shape[1]
        qk = ix.index_qk_proj(x)[0]
        nq = ix.index_n_heads * ix.index_head_dim
        q = apply_rotary_pos_emb(ix.q_layernorm(qk[:, :nq].reshape(t, -1, ix.index_head_dim)),
                                 cos=cos[0], sin=sin[0], unsqueeze_dim=1)
        nb = t // r
        kb = ix.k_layernorm(qk[: nb * r, nq:].reshape(nb, r, -1).mean(1))
        starts = torch.arange(nb) * r
        kb = apply_rotary_pos_emb(kb[:, None], cos=cos[0][starts], sin=sin[0][starts], unsqueeze_dim=1)[:, 0]
        scores = torch.relu(torch.einsum("thd,bd->tbh", q, kb)).sum(-1)
        for qpos in range(t):
            vis = (qpos + 1) // r
            if vis <= k_top:
                continue
            s = torch.sort(scores[qpos, :vis], descending=True).values
            if s[k_top - 1] - s[k_top] <= tol * max(float(s[0]), 1e-30):
                ties += 1
    return ties


def mtp_reference(model: Qwen4ExpForCausalLM, mtp_layer, mtp_tensors: dict, hidden: np.ndarray,
                  next_tokens) -> np.ndarray:
    """docs/model.md §11 in float64, built from the reference's own blocks:
    e = fc_embedding(norm_H(embed(next))); x0_s = fc_hidden(norm_W(hm)_s) + e; one attention decoder layer;
    mtp mixer; lm_head. `mtp_layer` is a Qwen4ExpTextDecoderLayer holding mtp.layers.0."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedResidual, Qwen4ExpTextRMSNorm

    cfg = model.config
    s, hid = cfg.hc_count, cfg.hidden_size
    t = hidden.shape[0]
    w = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in mtp_tensors.items()}
    norm_e = Qwen4ExpTextRMSNorm(hid, eps=cfg.rms_norm_eps).double()
    norm_e.weight.copy_(w["mtp.pre_fc_norm_embedding.weight"])
    norm_h = Qwen4ExpTextRMSNorm(s * hid, eps=cfg.rms_norm_eps).double()  # one norm over all W elements
    norm_h.weight.copy_(w["mtp.pre_fc_norm_hidden.weight"])
    mixer = Qwen4ExpTextGatedResidual(cfg, use_combine=False).double()
    for name in ("hc_norm", "input_mix_weight_down", "input_mix_weight_up"):
        getattr(mixer, name).weight.copy_(w[f"mtp.hyper_connection_mixer.{name}.weight"])

    ids = torch.as_tensor(np.asarray(next_tokens), dtype=torch.long)
    e = torch.nn.functional.linear(norm_e(model.model.embed_tokens(ids)), w["mtp.fc_embedding.weight"])
    hn = norm_h(torch.as_tensor(hidden)).reshape(t, s, hid)
    x0 = (torch.nn.functional.linear(hn, w["mtp.fc_hidden.weight"]) + e[:, None, :]).reshape(1, t, s * hid)
    pos = torch.arange(t)[None, None].expand(3, 1, t)
    cos_sin = model.model.rotary_emb(x0, pos)
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))[None, None]
    out = mtp_layer(x0, position_embeddings=cos_sin, attention_mask=mask, conv_mask=None, past_key_values=None)
    return model.lm_head(mixer(out))[0].numpy()


def random_mtp(model: Qwen4ExpForCausalLM, seed: int = 1):
    """A random MTP head for `model`: (the decoder layer module, checkpoint tensors mtp.*)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextDecoderLayer

    cfg = model.config
    attn_idx = cfg.layer_types.index("indexed_attention")
    layer = Qwen4ExpTextDecoderLayer(cfg, attn_idx).double().eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in layer.named_parameters():
        mean, std = _std(name, tuple(p.shape))
        p.copy_((mean + std * torch.randn(p.shape, generator=gen, dtype=torch.float64)).float())
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([layer])
    tensors = {}
    for name, a in checkpoint_tensors_of(holder.state_dict(), cfg).items():
        tensors[f"mtp.{name}"] = a
    s, hid = cfg.hc_count, cfg.hidden_size

    def rnd(*shape, mean=0.0, std=None):
        std = 1.0 / math.sqrt(shape[-1]) if std is None else std
        return (mean + std * torch.randn(shape, generator=gen, dtype=torch.float64)).numpy()

    tensors.update({
        "mtp.pre_fc_norm_embedding.weight": rnd(hid, std=0.2),
        "mtp.pre_fc_norm_hidden.weight": rnd(s * hid, std=0.2),
        "mtp.fc_embedding.weight": rnd(hid, hid),
        "mtp.fc_hidden.weight": rnd(hid, hid),
        "mtp.hyper_connection_mixer.hc_norm.weight": rnd(s * hid, std=0.2),
        "mtp.hyper_connection_mixer.input_mix_weight_down.weight": rnd(cfg.hc_lowrank, s * hid),
        "mtp.hyper_connection_mixer.input_mix_weight_up.weight": rnd(s * hid, cfg.hc_lowrank),
    })
    return layer, tensors
