"""Expert store: records from safetensors files, byte-exact; the load plan's checks; host memory limits."""

from __future__ import annotations

import os
import warnings

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxflash import ffi as F
from jaxflash.ffi.memory import (
    HostMemory,
    cgroup_v1_limit,
    cgroup_v2_limit,
    parse_meminfo,
    parse_proc_cgroup,
    pinning_fits,
    read_host_memory,
)
from test_ffi_support import SafetensorsIndex

H, I = 64, 32


def _nvfp4_expert(rng):
    """Random per-expert NVFP4 tensors keyed by suffix (shapes of docs/model.md §12 at H=64, I=32)."""
    t = {}
    for p, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        t[f"{p}.weight"] = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        t[f"{p}.weight_scale"] = rng.integers(0, 0x7F, (n, k // 16), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
        t[f"{p}.weight_scale_2"] = np.array(rng.uniform(1e-4, 1e-2), np.float32)
        t[f"{p}.input_scale"] = np.array(1.0, np.float32)  # present in real checkpoints, not stored in the pool
    return t


def _write_nvfp4_checkpoint(tmp_path, layers, num_experts, seed=0):
    """Experts of each layer split over two files (odd experts in the second), as sharded checkpoints do."""
    rng = np.random.default_rng(seed)
    experts, paths = {}, []
    for li in layers:
        files = ({}, {})
        for e in range(num_experts):
            experts[li, e] = _nvfp4_expert(rng)
            for suffix, arr in experts[li, e].items():
                files[e % 2][f"layers.{li}.mlp.experts.{e}.{suffix}"] = arr
        for half, tensors in enumerate(files):
            path = tmp_path / f"model-{li}-{half}.safetensors"
            save_file(tensors, str(path))
            paths.append(path)
    return SafetensorsIndex(paths), experts


def test_layout_sizes_of_the_full_model():
    layout = F.ExpertLayout("nvfp4", 2560, 640)
    assert layout.record_bytes == 2_765_056  # gate+up+down NVFP4 incl. scales: the ~2.76 MB of docs/engine.md
    assert all(s.offset % 256 == 0 for s in layout.sections.values())
    bf = F.ExpertLayout("bf16", 2560, 640)
    assert bf.record_bytes == 3 * 2560 * 640 * 2


def test_nvfp4_pool_bytes_equal_file_bytes(tmp_path):
    layers, E = [3, 5], 7  # pool layer j holds decoder layer layers[j]
    ckpt, experts = _write_nvfp4_checkpoint(tmp_path, layers, E)
    layout = F.ExpertLayout("nvfp4", H, I)
    with F.ExpertPool.from_checkpoint(ckpt, layout, layers, E, threads=3) as pool:
        arr = pool.array
        assert arr.shape == (2, E, layout.record_bytes)
        for j, li in enumerate(layers):
            for e in range(E):
                np.testing.assert_array_equal(arr[j, e], layout.pack(experts[li, e]))
                # and section by section, against the tensors as written
                gu = layout.view(arr[j, e], "gate_up_weight")
                np.testing.assert_array_equal(gu[:I], experts[li, e]["gate_proj.weight"])
                np.testing.assert_array_equal(gu[I:], experts[li, e]["up_proj.weight"])
                sc = layout.view(arr[j, e], "down_scale").view(np.uint8)
                np.testing.assert_array_equal(sc, experts[li, e]["down_proj.weight_scale"].view(np.uint8))
                s2 = layout.view(arr[j, e], "scale_2")
                np.testing.assert_array_equal(
                    s2, [experts[li, e][f"{p}.weight_scale_2"] for p in ("gate_proj", "up_proj", "down_proj")])
        # The plan reads exactly the file bytes the index points at.
        for path, off, n, dest in F.expert_plan(ckpt.location, layout, F.layer_prefixes(layers), E):
            with open(path, "rb") as f:
                f.seek(off)
                assert f.read(n) == arr.reshape(-1)[dest : dest + n].tobytes()


def test_bf16_pool_from_fused_layout(tmp_path):
    """BF16 experts stored fused, as transformers saves them ([E, 2I, H] gate rows then up rows; [E, H, I])."""
    E = 5
    rng = np.random.default_rng(1)
    gu = rng.standard_normal((E, 2 * I, H)).astype(ml_dtypes.bfloat16)
    dn = rng.standard_normal((E, H, I)).astype(ml_dtypes.bfloat16)
    save_file({"layers.0.mlp.experts.gate_up_proj": gu, "layers.0.mlp.experts.down_proj": dn},
              str(tmp_path / "m.safetensors"))
    ckpt = SafetensorsIndex([tmp_path / "m.safetensors"])
    layout = F.ExpertLayout("bf16", H, I)
    with F.ExpertPool.from_checkpoint(ckpt, layout, [0], E) as pool:
        for e in range(E):
            rec = pool.array[0, e]
            np.testing.assert_array_equal(layout.view(rec, "gate_up_weight").view(np.uint16), gu[e].view(np.uint16))
            np.testing.assert_array_equal(layout.view(rec, "down_weight").view(np.uint16), dn[e].view(np.uint16))


def test_bf16_per_expert_names(tmp_path):
    rng = np.random.default_rng(2)
    tensors, E = {}, 3
    for e in range(E):
        for p, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            tensors[f"layers.0.mlp.experts.{e}.{p}.weight"] = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    layout = F.ExpertLayout("bf16", H, I)
    with F.ExpertPool.from_checkpoint(SafetensorsIndex([tmp_path / "m.safetensors"]), layout, [0], E) as pool:
        for e in range(E):
            want = layout.pack({k.split(f"experts.{e}.")[1]: v for k, v in tensors.items() if f"experts.{e}." in k})
            np.testing.assert_array_equal(pool.array[0, e], want)


def test_plan_rejects_mismatched_tensors(tmp_path):
    ckpt, _ = _write_nvfp4_checkpoint(tmp_path, [0], 2)
    with pytest.raises(ValueError, match="expert layout expects uint8 \\[32, 64\\]"):
        F.expert_plan(ckpt.location, F.ExpertLayout("nvfp4", 128, I), ["layers.0.mlp.experts"], 2)
    with pytest.raises(KeyError, match="layers.0.mlp.experts.2.gate_proj.weight"):
        F.expert_plan(ckpt.location, F.ExpertLayout("nvfp4", H, I), ["layers.0.mlp.experts"], 3)
    with pytest.raises(ValueError, match="unsupported expert tensor dtype"):
        F.normalize_dtype("F16")


def test_load_errors_name_the_file(tmp_path):
    layout = F.ExpertLayout("nvfp4", H, I)
    with F.ExpertPool(layout, 1, 2, pin=False) as pool:
        missing = str(tmp_path / "nope.safetensors")
        with pytest.raises(RuntimeError, match="cannot open .*nope.safetensors"):
            pool.load([(missing, 0, 16, 0)])
        small = tmp_path / "small.bin"
        small.write_bytes(b"x" * 100)
        with pytest.raises(IndexError, match="small.bin has 100 bytes"):
            pool.load([(str(small), 90, 16, 0)])
        with pytest.raises(IndexError, match="outside the pool"):
            pool.load([(str(small), 0, 16, pool.nbytes - 8)])


def test_pinning_fallback_warns_and_never_crashes():
    layout = F.ExpertLayout("nvfp4", H, I)
    tight = HostMemory(mem_total=8 << 30, mem_available=4 << 30, cgroup_version=2, cgroup_limit=1 << 30,
                       cgroup_usage=900 << 20)
    fits, why = pinning_fits(1 << 30, tight)
    assert not fits and "cgroup v2 limit 1.0 GiB" in why
    if F.module().has_cuda and F.module().cuda_device_count() > 0:
        with pytest.warns(F.PinningWarning, match="not pinned"):
            pool = F.ExpertPool(layout, 1, 4, memory=tight)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pool = F.ExpertPool(layout, 1, 4)  # auto: nothing to pin on a CPU-only machine, no warning
        assert not pool.pinned
        pool.close()
        with pytest.warns(F.PinningWarning, match="not pinned"):
            pool = F.ExpertPool(layout, 1, 4, pin=True)
    assert not pool.pinned
    pool.array[...] = 7  # usable all the same
    pool.close()


# ----- host memory limits --------------------------------------------------------------------------------------
def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_parse_meminfo_and_proc_cgroup():
    info = parse_meminfo("MemTotal:       24683652 kB\nMemAvailable:   24252708 kB\nHugePages_Total:       0\n")
    assert info["MemTotal"] == 24683652 * 1024 and info["HugePages_Total"] == 0
    assert parse_proc_cgroup("0::/user.slice/app.scope\n") == ("/user.slice/app.scope", None)
    hybrid = "9:name=systemd:/\n4:memory:/process_api/abc\n3:cpu,cpuacct:/\n0::/\n"
    assert parse_proc_cgroup(hybrid) == ("/", "/process_api/abc")


def test_cgroup_v2_takes_the_tightest_ancestor(tmp_path):
    root = str(tmp_path / "cg")
    _write(f"{root}/cgroup.controllers", "cpu memory\n")
    _write(f"{root}/a/memory.max", str(8 << 30))
    _write(f"{root}/a/b/memory.max", "max\n")
    _write(f"{root}/a/b/memory.current", str(1 << 30))
    assert cgroup_v2_limit(root, "/a/b") == (8 << 30, 1 << 30)
    proc = str(tmp_path / "proc")
    _write(f"{proc}/meminfo", "MemTotal: 67108864 kB\nMemAvailable: 33554432 kB\n")
    _write(f"{proc}/self/cgroup", "0::/a/b\n")
    mem = read_host_memory(proc, root)
    assert mem.cgroup_version == 2 and mem.cgroup_limit == 8 << 30
    assert mem.available == 7 << 30  # the cgroup's headroom is below MemAvailable (32 GiB)


def test_cgroup_v2_namespaced_root(tmp_path):
    """Inside a cgroup namespace /proc/self/cgroup says '/', and the limit sits at the mount root."""
    root = str(tmp_path / "cg")
    _write(f"{root}/cgroup.controllers", "memory\n")
    _write(f"{root}/memory.max", str(4 << 30))
    _write(f"{root}/memory.current", str(3 << 30))
    assert cgroup_v2_limit(root, "/") == (4 << 30, 3 << 30)


def test_cgroup_v1_unlimited_and_limited(tmp_path):
    root = str(tmp_path / "memory")
    _write(f"{root}/memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    _write(f"{root}/job/memory.limit_in_bytes", str(16 << 30))
    _write(f"{root}/job/memory.usage_in_bytes", str(2 << 30))
    assert cgroup_v1_limit(root, "/job") == (16 << 30, 2 << 30)
    assert cgroup_v1_limit(root, "/") == (None, None)
    proc = str(tmp_path / "proc")
    _write(f"{proc}/meminfo", "MemAvailable: 1048576 kB\n")
    _write(f"{proc}/self/cgroup", "4:memory:/job\n0::/\n")
    mem = read_host_memory(proc, str(tmp_path))
    assert mem.cgroup_version == 1 and mem.cgroup_limit == 16 << 30
    assert mem.available == 1 << 30  # MemAvailable is the tighter bound here


def test_read_host_memory_on_this_machine():
    mem = read_host_memory()
    assert mem.available is None or mem.available > 0
    assert isinstance(mem.describe(), str)


@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
def test_pool_and_table_from_a_jaxflash_checkpoint(tmp_path, quant):
    """The pool and the n-gram table through jaxflash.checkpoint's reader on a synthetic checkpoint."""
    synthetic = pytest.importorskip("jaxflash.synthetic")
    checkpoint = pytest.importorskip("jaxflash.checkpoint")
    cfg = synthetic.make_config("tiny")
    ck = checkpoint.Checkpoint.open(synthetic.write_checkpoint(str(tmp_path / quant), cfg, quant=quant,
                                                               progress=False))
    c = ck.config
    layout = F.ExpertLayout.from_config(c, quant)
    layers = list(range(c.num_hidden_layers))
    with F.ExpertPool.from_checkpoint(ck, layout, layers, c.num_experts) as pool:
        for layer, e in ((0, 0), (c.num_hidden_layers - 1, c.num_experts - 1), (3, 5)):
            rec = pool.array[layer, e]
            for slot in layout.tensors:
                got = rec[slot.offset : slot.offset + slot.nbytes]
                want = np.ascontiguousarray(ck.read(f"layers.{layer}.mlp.experts.{e}.{slot.suffix}"))
                np.testing.assert_array_equal(got, want.reshape(-1).view(np.uint8), err_msg=slot.suffix)
    base = f"layers.{c.ple_layers[0]}.ple.ple_embedding.ngram_embedding"
    names = [f"{base}.shard_{i}.weight" for i in range(c.split_ngram_parts)]
    full = np.concatenate([np.asarray(ck.read(n)) for n in names] if ck.has(names[0])
                          else [np.asarray(ck.read(f"{base}.weight"))])
    with F.NgramTable.from_checkpoint(ck, c) as table:
        ids = np.array([0, 1, 12345, table.rows - 1])
        np.testing.assert_array_equal(table.lookup(ids).view(np.uint8), full[ids].view(np.uint8))
