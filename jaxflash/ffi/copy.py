"""`uncaptured_copy`: copy arrays with an op that XLA keeps out of its command buffers (CUDA graphs).

XLA replays a program's captured part as one CUDA graph as long as every buffer the graph touches keeps its
address; when one moves, XLA updates the graph, which costs milliseconds of host time on every call for a
graph of a decode step's size. The weights, the donated state and XLA's temporaries keep their addresses;
a program's per-call inputs are fresh buffers each call. Copying an input in with this op (a custom call
without the command-buffer trait: plain async device-to-device copies on the GPU, memcpy on the CPU) keeps
the graph from reading it. Measured on the H200 (benchmarks/graph_updates.py): a fresh input read by the
graph updates it on every call, the same input copied in does not. Copying an *output* out the same way does
not help: a program with any fresh output buffer still has its graph updated on every call.
"""

from __future__ import annotations

import jax

from . import _ext


def uncaptured_copy(tree):
    """A copy of every array in `tree` (same structure), made outside any CUDA graph."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    _ext.module()
    out = jax.ffi.ffi_call("jaxflash_copy", [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves])(*leaves)
    return jax.tree.unflatten(treedef, out)
