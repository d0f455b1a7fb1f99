"""benchmarks/kernel_sass.py: its SASS loop profile and opcode counts on hand-made listings, the capture of the
expert and mix kernels' Triton modules lowered for a CUDA GPU on this machine (no device), and, where Triton is
installed, their compilation for sm_90."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import kernel_sass  # noqa: E402

LISTING = """
        Function : kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;                     /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;               /* 0x0000000404027981 */
        /*0020*/                   WARPSYNC 0xffffffff ;                      /* 0x0000000000007948 */
        /*0030*/                   SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;          /* 0x0c201f0002037f89 */
        /*0040*/               @P0 BRA 0x20 ;                                 /* 0xfffffff000800947 */
        /*0050*/                   LDG.E.64 R6, desc[UR4][R8.64] ;            /* 0x0000000408067981 */
        /*0060*/                   LDG.E.64 R10, desc[UR4][R8.64+0x40] ;      /* 0x000040040a0a7981 */
        /*0070*/                   HFMA2 R12, R6, R10, R12 ;                  /* 0x0000000a060c7231 */
        /*0080*/                   HFMA2 R12, R7, R11, R12 ;                  /* 0x0000000b070c7231 */
        /*0090*/              @!P1 BRA 0x50 ;                                 /* 0xfffffff000800947 */
        /*00a0*/                   ISETP.GE.AND P2, PT, R0, 0x3, PT ;         /* 0x000000030000780c */
        /*00b0*/               @P2 BRA 0x0 ;                                  /* 0xfffffff000800947 */
        /*00c0*/                   EXIT ;                                     /* 0x000000000000794d */
        /*00d0*/                   BRA 0xd0;                                  /* 0xfffffffc00fc7947 */
"""


def test_loop_profile_takes_the_innermost_loop_with_the_loads():
    """Three backward branches: a collective loop (no global load), the walk (two loads), and an outer loop
    around both; the walk's body is the profile."""
    p = kernel_sass.loop_profile(LISTING)
    assert p["instructions"] == 14
    assert p["loop"] == 5  # 0x50 .. 0x90
    assert p["opcodes"] == {"LDG": 2, "HFMA2": 2, "BRA": 1}


def test_loop_profile_without_a_loop():
    p = kernel_sass.loop_profile("        /*0000*/                   EXIT ;   /* 0x000000000000794d */\n")
    assert p == {"instructions": 1, "loop": 0, "opcodes": {}}


def test_the_expert_kernels_are_captured_for_a_cuda_gpu():
    """The lowering for CUDA runs here (no device): both kernels' Triton modules, in program order; a jax whose
    private lowering moved fails here, not only on a machine with Triton."""
    from jaxflash.kernels import nvfp4_experts as K

    fn, args, _ = kernel_sass.expert_call(K.Tiles(), 1, hidden=64, inter=32, top_k=2, experts=4)
    modules = kernel_sass.capture_triton_modules(fn, *args)
    assert [name for name, _ in modules] == ["nvfp4_gate_up", "nvfp4_down"]
    assert all("tt.load" in text and "tt.store" in text for _, text in modules)


def test_the_mix_kernels_are_captured_for_a_cuda_gpu():
    """The hyper-connection mix lowers to its two kernels for a few rows, and from hc_mix.GATES_FROM_ROWS rows to
    three: the partials combined once per row (hc_mix_gates) between them."""
    from jaxflash.kernels import hc_mix

    for rows, names in ((1, ["hc_mix_down", "hc_mix_up"]),
                        (hc_mix.GATES_FROM_ROWS, ["hc_mix_down", "hc_mix_gates", "hc_mix_up"])):
        fn, args = kernel_sass.hc_call(rows, hidden=64, rank=32)
        assert [name for name, _ in kernel_sass.capture_triton_modules(fn, *args)] == names


def test_opcodes_and_spills():
    ops = kernel_sass.opcodes(LISTING)
    assert ops["LDG"] == 3 and ops["BRA"] == 4 and sum(ops.values()) == 14 and kernel_sass.spills(ops) == 0
    local = "        /*0000*/                   STL [R1+0x4], R2 ;   /* 0x0 */\n" \
            "        /*0010*/              @P0 LDL R3, [R1+0x4] ;   /* 0x0 */\n"
    assert kernel_sass.spills(kernel_sass.opcodes(local)) == 2


def test_compiled_for_sm90_where_triton_is_installed(tmp_path):
    pytest.importorskip("triton")
    rows = kernel_sass.expert_kernels("auto", kernel_sass.parse_tiles("default")[0], 1, str(tmp_path))
    assert [r["kernel"] for r in rows] == ["nvfp4_gate_up", "nvfp4_down"]
    assert all(r["registers"] > 0 and r["loop"] > 0 and r["per_byte"] > 0 for r in rows)
    mixes = kernel_sass.hc_kernels(4, str(tmp_path))  # full size: the up kernel spilled at 4 rows before the gates
    assert [r["kernel"] for r in mixes] == ["hc_mix_down", "hc_mix_gates", "hc_mix_up"]
    assert all(r["spills"] == 0 for r in mixes)
