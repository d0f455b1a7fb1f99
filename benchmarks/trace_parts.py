#!/usr/bin/env python3
"""Split the GPU time of traced steps by part of the model, from a JAX profiler trace and the program's HLO.

The engine's programs put `jax.named_scope`s on every part (jaxflash/model/transformer.py and moe.py:
`layer_i/attention`, `layer_i/gdn`, `.../hyper_connection`, `moe/router`, `moe/routed_experts` with `resolve`
and `gather` under it, `moe/shared_expert`, `ple`, `ple_host_step`, `mtp`, `lm_head`, `sampling`). XLA keeps
the scope path in each instruction's `op_name` metadata, and every GPU kernel in the trace names the
instruction it ran for (its `hlo_op`, or its own name: XLA names a fusion's kernel after the fusion). So:

    kernel -> HLO instruction -> named-scope path -> part

Kernels of no instruction of the program (e.g. kernels an FFI handler launches, or a library's kernels with
no op attached) fall into "unattributed". Record the trace around N steps after warm-up:

    with jax.profiler.trace(DIR, create_perfetto_trace=True):
        for _ in range(N): ...
    python benchmarks/trace_parts.py DIR --steps N --hlo program.txt     # program.txt: Compiled.as_text()
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys

# The part a kernel belongs to: the first of these labels found among its scope path's components.
PARTS = [
    ("mtp", "MTP head"),
    ("mtp_head", "MTP head"),
    ("gather", "expert gather (PCIe)"),
    ("resolve", "expert cache resolve"),
    ("routed_experts", "routed experts"),
    ("router", "router"),
    ("shared_expert", "shared expert"),
    ("hyper_connection", "hyper-connections"),
    ("ple_host_step", "PLE host step"),
    ("ple", "PLE"),
    ("attention", "attention"),
    ("gdn", "GDN"),
    ("lm_head", "final mixer + lm_head"),
    ("sampling", "sampling"),
]


# Kernels that jaxflash's FFI handlers launch inside the captured graph carry no HLO op; their names say what
# they are.
KERNEL_PARTS = [
    ("gather_zero_copy_kernel", "expert gather (PCIe)"),
    ("resolve_kernel", "expert cache resolve"),
    ("nvfp4_gate_up", "routed experts"),  # the Pallas expert kernels (jaxflash/kernels/nvfp4_experts.py)
    ("nvfp4_down", "routed experts"),
    ("nvfp4_experts", "routed experts"),  # their one-launch form
    ("nvfp4_moe_gate_up", "routed experts"),  # the CUDA expert kernels (ffi/nvfp4_moe.cu)
    ("nvfp4_moe_down", "routed experts"),
    ("nvfp4_grouped_gate_up", "routed experts"),  # prefill's grouped kernels (jaxflash/kernels/nvfp4_grouped.py)
    ("nvfp4_grouped_down", "routed experts"),
    ("gdn_decode", "GDN"),  # the GDN decode kernel (jaxflash/kernels/gdn_decode.py)
    ("attention_decode", "attention"),  # the paged attention kernel (jaxflash/kernels/attention_decode.py)
    ("attention_combine", "attention"),  # its splits' combine with the output gate
    ("attention_new_rows", "attention"),  # the kernels around it (jaxflash/kernels/attention_prep.py)
    ("qsa_block_scores", "attention"),
    ("moe_inputs", "router"),  # the router's choice and the shared expert's activation (kernels/moe_inputs.py)
    ("hc_mix", "hyper-connections"),  # the mix kernels (jaxflash/kernels/hc_mix.py), the final mixer's included
]


def gpu_kernels(trace_dir: str, module: str | None = None) -> list[dict]:
    """The GPU kernel events (ph X on a GPU process) of the newest perfetto trace under trace_dir. With
    `module` (e.g. "jit_decode"), the XLA:CPU ops of that program instead: the CPU backend runs its thunks on
    host threads, which lets the attribution be tested without a GPU."""
    files = ([trace_dir] if os.path.isfile(trace_dir)  # a trace file itself (decode.py --keep-trace keeps one)
             else glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir} (trace with create_perfetto_trace=True)")
    with gzip.open(max(files, key=os.path.getmtime), "rt") as f:
        tr = json.load(f)
    ev = tr["traceEvents"] if isinstance(tr, dict) else tr
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in ev
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    if module is not None:
        keep = [e for e in ev if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == module]
    else:
        gpu = {p for p, n in names.items() if "GPU" in n or "/device:" in n}
        keep = [e for e in ev if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]
    return sorted(keep, key=lambda e: e["ts"])


def scopes_of(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its op_name scope path (under the name and its kernel spelling, dots as _).
    An instruction with no metadata of its own (a fusion XLA formed, a copy it inserted) takes the most
    common scope among the instructions of the computation it calls, if any. A fusion that holds a matrix
    product (dot) takes the product's op_name, whatever its root (XLA names a GEMM fusion's metadata after its
    last op, often a convert), so that products are listed as dot_general."""
    line_re = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")
    comp_re = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")
    own, calls, members, dots, comp = {}, {}, collections.defaultdict(list), {}, None
    for line in hlo_text.splitlines():
        if (c := comp_re.match(line)) and " = " not in line:
            comp = c.group(1)
            continue
        if not (m := line_re.match(line)):
            continue
        name, rest = m.group(1), m.group(2)
        op = re.search(r'op_name="([^"]*)"', rest)
        if op:
            own[name] = op.group(1)
            if comp:
                members[comp].append(op.group(1))
                if re.search(r"\sdot\(", rest):
                    dots.setdefault(comp, op.group(1))
        if callee := re.search(r"calls=%?([\w.\-]+)", rest):
            calls[name] = (callee.group(1), op is not None)
    for name, (callee, has_own) in calls.items():
        if callee in dots:
            own[name] = dots[callee]
        elif not has_own and members.get(callee):
            scopes = collections.Counter(o.rsplit("/", 1)[0] for o in members[callee])
            own[name] = scopes.most_common(1)[0][0] + "/fusion"
    out = {}
    for name, op in own.items():
        out[name] = op
        out[name.replace(".", "_").replace("-", "_")] = op
    return out


def part_of(scope: str | None) -> str:
    if scope is None:
        return "unattributed"
    parts = scope.split("/")[:-1]  # the last component is the JAX primitive (gather, dot_general, ...)
    for label, part in PARTS:
        if label in parts:
            return part
    return "other (embedding, glue)"


def busy_us(events: list[dict]) -> float:
    """The union of the kernels' intervals (overlapping kernels count once)."""
    total, start, end = 0.0, None, None
    for e in events:
        s, d = e["ts"], e["ts"] + e["dur"]
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, d
        else:
            end = max(end, d)
    return total + (end - start if end is not None else 0.0)


def steady_state(events: list[dict]) -> dict | None:
    """The period and busy time of repeated launches of the biggest CUDA graph (one per step), from its second
    launch to its last: the steady state, free of the trace's start. None without graphs."""
    graph = collections.Counter(e.get("args", {}).get("cuda_graph_id") for e in events
                                if e.get("args", {}).get("cuda_graph_id"))
    if not graph:
        return None
    main = graph.most_common(1)[0][0]
    starts, prev = [], None
    for e in events:  # a launch starts where a kernel of the main graph follows one of another graph
        g = e.get("args", {}).get("cuda_graph_id")
        if not g:  # a kernel outside the graphs (an uncaptured custom call's) separates nothing
            continue
        if g == main and prev != main:
            starts.append(e["ts"])
        prev = g
    if len(starts) < 3:
        return None
    t0, t1 = starts[1], starts[-1]
    inside = [dict(e, ts=max(e["ts"], t0), dur=min(e["ts"] + e["dur"], t1) - max(e["ts"], t0))
              for e in events if e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    n = len(starts) - 2
    return {"steps": n, "period_ms": (t1 - t0) / 1e3 / n, "busy_ms": busy_us(inside) / 1e3 / n}


def _attribute(e: dict, scopes: dict[str, str]) -> tuple[str | None, str]:
    """A kernel event's scope (None if its op has none) and part; FFI kernels by their names (KERNEL_PARTS)."""
    args = e.get("args", {})
    op = args.get("hlo_op") or args.get("long_name") or e["name"]
    scope = scopes.get(op) or scopes.get(e["name"])
    part = part_of(scope)
    if part == "unattributed":
        part = next((p for k, p in KERNEL_PARTS if k in e["name"]), part)
    return scope, part


def summarise(events: list[dict], steps: int, hlo_text: str | None = None) -> dict:
    """Per step: kernels, busy and span time, share of kernels inside CUDA graphs, and time by part."""
    if not events:
        raise ValueError("the trace holds no GPU kernels")
    scopes = scopes_of(hlo_text) if hlo_text else {}
    by_part, n_part = collections.Counter(), collections.Counter()
    unknown = collections.Counter()
    for e in events:
        part = _attribute(e, scopes)[1] if scopes else "all"
        if part == "unattributed":
            unknown[e["name"][:80]] += e["dur"]
        by_part[part] += e["dur"]
        n_part[part] += 1
    t0, t1 = events[0]["ts"], max(e["ts"] + e["dur"] for e in events)
    durs = sorted(e["dur"] for e in events)
    return {
        "steps": steps,
        "kernels_per_step": len(events) / steps,
        "in_cuda_graph": sum(1 for e in events if e.get("args", {}).get("cuda_graph_id")) / len(events),
        "busy_ms_per_step": busy_us(events) / 1e3 / steps,
        "span_ms_per_step": (t1 - t0) / 1e3 / steps,
        "median_kernel_us": durs[len(durs) // 2],
        "parts_ms_per_step": {k: v / 1e3 / steps for k, v in by_part.most_common()},
        "kernels_per_step_by_part": {k: n_part[k] / steps for k, _ in by_part.most_common()},
        "unattributed_top": [(k, v / 1e3 / steps) for k, v in unknown.most_common(8)],
        "steady": steady_state(events),
    }


def kernels_of(events: list[dict], steps: int, hlo_text: str, part: str) -> list[tuple[str, float, float]]:
    """The kernels of one part, grouped by their scope with layer numbers as `layer_*` (one group per kind of
    kernel in every layer): (scope or kernel name, kernels per step, us per step), longest first."""
    scopes = scopes_of(hlo_text)
    time, count = collections.Counter(), collections.Counter()
    for e in events:
        scope, got = _attribute(e, scopes)
        if got != part:
            continue
        key = re.sub(r"layer_\d+", "layer_*", scope) if scope else e["name"][:80]
        time[key] += e["dur"]
        count[key] += 1
    return [(k, count[k] / steps, us / steps) for k, us in time.most_common()]


def format_summary(r: dict) -> str:
    lines = [f"kernels/step {r['kernels_per_step']:.0f} ({r['in_cuda_graph']:.0%} in CUDA graphs), GPU busy "
             f"{r['busy_ms_per_step']:.2f} ms/step, span {r['span_ms_per_step']:.2f} ms/step, median kernel "
             f"{r['median_kernel_us']:.1f} us"]
    if r.get("steady"):
        s = r["steady"]
        lines.append(f"steady state over {s['steps']} steps: {s['period_ms']:.2f} ms per step, GPU busy "
                     f"{s['busy_ms']:.2f} ms ({s['period_ms'] / s['busy_ms']:.3f} x)")
    for part, ms in r["parts_ms_per_step"].items():
        lines.append(f"  {ms:8.3f} ms/step  {r['kernels_per_step_by_part'][part]:7.1f} kernels  {part}")
    for name, ms in r["unattributed_top"]:
        lines.append(f"      unattributed {ms:.3f} ms/step: {name}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir")
    ap.add_argument("--steps", type=int, required=True, help="how many steps the trace holds")
    ap.add_argument("--hlo", help="the traced program's optimized HLO text (jax Compiled.as_text())")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--list", metavar="PART", help="also list the kernels of this part (e.g. attention) by scope; "
                    "needs --hlo")
    a = ap.parse_args(argv)
    hlo = (gzip.open(a.hlo, "rt") if a.hlo.endswith(".gz") else open(a.hlo)).read() if a.hlo else None
    events = gpu_kernels(a.trace_dir)
    r = summarise(events, a.steps, hlo)
    print(format_summary(r))
    if a.list:
        if hlo is None:
            ap.error("--list needs --hlo")
        print(f"kernels of {a.list} per step:")
        for key, n, us in kernels_of(events, a.steps, hlo, a.list):
            print(f"  {us:8.1f} us  {n:5.1f} kernels  {key}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
