"""Tests run on the CPU: force JAX's CPU backend before anything imports jax."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))  # the shared reference helpers (hf_reference.py)
