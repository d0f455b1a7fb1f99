"""benchmarks/trace_parts.py splits a traced step's time by the named scopes the model's layers carry. On the
CPU the trace holds XLA:CPU ops instead of GPU kernels (same hlo_op naming), which is enough to check that
every part of a decode step is found and that little is left unattributed."""

from __future__ import annotations

import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import trace_parts  # noqa: E402


@pytest.mark.xdist_group("nvfp4")  # conftest.py's NVFP4 engines, shared with test_engine.py
def test_decode_step_time_splits_by_part(nvfp4_mtp, tmp_path):
    # conftest.py's synthetic NVFP4 model, every block of the real one; mtp_drafts: the MTP head runs in the
    # decode step, so its part is attributed too
    sched = nvfp4_mtp.scheduler
    (req,) = sched.make_requests([[5, 6, 7, 8]], max_new_tokens=40, temperature=0.0, top_p=1.0, top_k=0,
                                 min_p=0.0, seed=0, stop=None, eos_ids=(), ignore_eos=True)
    sched.submit(req)
    for _ in range(4):  # admitted, first tokens read, decode warm
        sched.step()
    steps = 3
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(steps):
            sched.step()
        jax.block_until_ready(sched.runner.state)
    sched.cancel(req)
    while not sched.idle:
        sched.step()
    events = trace_parts.gpu_kernels(str(tmp_path), module="jit_decode")
    r = trace_parts.summarise(events, steps, sched.runner.program_text("decode", rows=1))  # the traced bucket
    parts = r["parts_ms_per_step"]
    for part in ("GDN", "attention", "hyper-connections", "router", "routed experts", "shared expert", "PLE",
                 "PLE host step", "MTP head", "final mixer + lm_head", "sampling"):
        assert parts.get(part, 0) > 0, (part, parts)
    assert parts.get("unattributed", 0) < 0.5 * sum(parts.values())
    assert r["kernels_per_step"] > 100 and r["busy_ms_per_step"] > 0
    listed = trace_parts.kernels_of(events, steps, sched.runner.program_text("decode", rows=1), "attention")
    assert listed and all("layer_*" in k or "layer_" not in k for k, _, _ in listed)  # layers grouped
    assert abs(sum(us for _, _, us in listed) / 1e3 - parts["attention"]) < 1e-9


def test_part_labels():
    assert trace_parts.part_of("j/layer_3/moe/routed_experts/gather/custom_call") == \
        "expert gather (PCIe)"
    assert trace_parts.part_of("j/layer_3/moe/routed_experts/gather") == "routed experts"  # a primitive
    assert trace_parts.part_of("jit(decode)/layer_0/gdn/hyper_connection/dot_general") == "hyper-connections"
    assert trace_parts.part_of("jit(decode)/mtp/layer_0/attention/dot_general") == "MTP head"
    assert trace_parts.part_of(None) == "unattributed"
    with pytest.raises(ValueError):
        trace_parts.summarise([], 1)


def test_ffi_kernels_are_named_parts():
    events = [{"name": "jaxflash::(anonymous namespace)::gather_zero_copy_kernel(int const*)", "ts": 0.0, "dur": 5.0,
               "args": {"cuda_graph_id": "7"}},
              {"name": "loop_add_fusion_3", "ts": 5.0, "dur": 1.0, "args": {"cuda_graph_id": "7"}}]
    hlo = 'ENTRY %main () -> f32[] {\n  %loop_add_fusion.3 = f32[] fusion(), metadata={op_name="jit(decode)/layer_0/gdn/add"}\n}\n'
    r = trace_parts.summarise(events, 1, hlo)
    assert r["parts_ms_per_step"] == {"expert gather (PCIe)": 0.005, "GDN": 0.001}


def test_fusions_holding_a_product_take_its_scope():
    """A GEMM fusion whose root (and own metadata) is a convert is listed under its dot's op_name; a fusion
    without metadata takes its members' commonest scope; one without a dot keeps its own."""
    meta = 'metadata={op_name="j/layer_3/%s"}'
    hlo = "\n".join([
        "%gemm_fusion_dot.7_computation (p0: bf16[1,8], p1: bf16[4,8]) -> bf16[1,4] {",
        "  %dot.1 = f32[1,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, " + meta % "gdn/dot_general",
        "  ROOT %convert.2 = bf16[1,4]{1,0} convert(%dot.1), " + meta % "gdn/convert_element_type",
        "}",
        "%fused_computation.9 (p0: f32[4]) -> f32[4] {",
        "  ROOT %add.3 = f32[4]{0} add(%p0, %p0), " + meta % "moe/hyper_connection/add",
        "}",
        "ENTRY %main () -> bf16[1,4] {",
        "  %gemm_fusion_dot.7 = bf16[1,4]{1,0} fusion(), kind=kCustom, calls=%gemm_fusion_dot.7_computation, "
        + meta % "gdn/convert_element_type",
        "  %fusion.9 = f32[4]{0} fusion(), kind=kLoop, calls=%fused_computation.9",
        "  ROOT %loop_add_fusion.2 = f32[4]{0} fusion(), calls=%fused_computation.9, " + meta % "gdn/add",
        "}"])
    scopes = trace_parts.scopes_of(hlo)
    assert scopes["gemm_fusion_dot_7"] == "j/layer_3/gdn/dot_general"
    assert scopes["fusion.9"] == "j/layer_3/moe/hyper_connection/fusion"
    assert scopes["loop_add_fusion.2"] == "j/layer_3/gdn/add"
