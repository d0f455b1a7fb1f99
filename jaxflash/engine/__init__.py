"""The inference engine: load a checkpoint, plan memory, prefill and decode with per-sequence state.

    core.py       Engine and load(): weights, residency, full-sequence logits
    planner.py    where the experts live; cache slots, KV pages and context length from the memory budget
    experts.py    the expert source of host residency: the VRAM LRU cache (decode steps and prefill chunks)
    runner.py     the weights, the device state of every slot, and the compiled prefill-chunk / decode-step
                  programs over them
    sampling.py   greedy / temperature / top-k / top-p / min-p with per-request seeds, inside the step
    scheduler.py  continuous batching in plain Python: admission, slots, KV pages, stop rules, events;
                  overlapped decode
"""

from .core import DEFAULT_MODEL, Engine, load
from .planner import Plan, PlanError
from .sampling import SamplingParams

__all__ = ["DEFAULT_MODEL", "Engine", "Plan", "PlanError", "SamplingParams", "load"]
