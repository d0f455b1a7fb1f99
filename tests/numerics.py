"""The tests' measure of numerical agreement."""

from __future__ import annotations

import numpy as np


def rel_err(out, ref) -> float:
    """max |out - ref| / max |ref|, in float64."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(out - ref).max() / np.abs(ref).max())
