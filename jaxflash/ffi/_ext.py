"""Loading the native module and registering its handlers with XLA.

Two builds of the same C++ exist (see CMakeLists.txt): `jaxflash_ffi` (CPU handlers) and `jaxflash_ffi_cuda`
(the same plus CUDA handlers). Exactly one is loaded, so one registry holds every expert pool and n-gram table:
the CUDA module where it imports and sees a CUDA device, the CPU module otherwise. The environment variable
JAXFLASH_FFI_MODULE=cpu|cuda overrides the choice.
"""

from __future__ import annotations

import os
import threading
from types import ModuleType

import jax

_lock = threading.Lock()
_module: ModuleType | None = None


def _import_cuda() -> ModuleType | None:
    try:
        import jaxflash_ffi_cuda  # built only where nvcc was found
    except ImportError:
        return None
    return jaxflash_ffi_cuda


def _import_cpu() -> ModuleType:
    try:
        import jaxflash_ffi
    except ImportError as e:
        raise ImportError(
            "jaxflash's native FFI module is not built; install the package with `pip install .` "
            "(or `pip install -e .`) from the repository root"
        ) from e
    return jaxflash_ffi


def _choose() -> ModuleType:
    choice = os.environ.get("JAXFLASH_FFI_MODULE", "auto").strip().lower()
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"JAXFLASH_FFI_MODULE={choice!r}: expected 'auto', 'cpu' or 'cuda'")
    if choice == "cpu":
        return _import_cpu()
    cuda = _import_cuda()
    if choice == "cuda":
        if cuda is None:
            raise ImportError("JAXFLASH_FFI_MODULE=cuda but jaxflash_ffi_cuda is not built (no nvcc at build time?)")
        return cuda
    if cuda is not None and cuda.cuda_device_count() > 0:
        return cuda
    return _import_cpu()


def module() -> ModuleType:
    """The native module in use; registers its FFI targets on first call."""
    global _module
    if _module is None:
        with _lock:
            if _module is None:
                mod = _choose()
                for name, capsule in mod.cpu_targets().items():
                    jax.ffi.register_ffi_target(name, capsule, platform="cpu", api_version=1)
                for name, capsule in mod.cuda_targets().items():
                    jax.ffi.register_ffi_target(name, capsule, platform="CUDA", api_version=1)
                _module = mod
    return _module


def handler_calls() -> dict[str, int]:
    """How many times each handler's C++ body has run (a captured handler's body runs only while XLA records
    the command buffer, not on replays)."""
    return dict(module().handler_calls())


def reset_handler_calls() -> None:
    module().reset_handler_calls()
