"""The inference engine: load a checkpoint, plan memory, prefill and decode with per-sequence state.

    core.py      Engine and load(): weights, residency, full-sequence logits
    planner.py   where the experts live; cache slots, KV pages and context length from the memory budget
    step.py      the compiled prefill-chunk and decode-step programs over one donated DecodeState
    sampling.py  greedy / temperature / top-k / top-p / min-p with per-request seeds, inside the step
    generate.py  the scheduler behind Engine.generate and Engine.generate_stream
"""

from .core import DEFAULT_MODEL, Engine, load
from .planner import Plan, PlanError
from .sampling import SamplingParams

__all__ = ["DEFAULT_MODEL", "Engine", "Plan", "PlanError", "SamplingParams", "load"]
