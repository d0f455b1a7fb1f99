"""jaxflash: run qwen4_exp (Qwen3.8-Flash-Next) on one GPU that cannot hold its experts.

    import jaxflash
    engine = jaxflash.load()                 # the bundled model; or jaxflash.load("checkpoint/dir")
    logits = engine.logits([1, 2, 3])

The functional model for JAX research code is `jaxflash.model` (see README.md).
"""

import os as _os


def _cpu_workaround() -> None:
    """jaxlib 0.10's XLA:CPU deadlocks on some of this model's programs: every thread idles and the call never
    returns (seen with 8 layers at 1024 tokens, and now and then in jax.grad). Each flag below removed part of
    it in repeated runs, all four together all of it: the XNNPACK/YNNPACK library fusions, the
    concurrency-optimised scheduler and the multi-threaded Eigen pool. Applied only to the jaxlib versions
    this was seen on, since XLA rejects flags it does not know."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        if not version("jaxlib").startswith("0.10."):
            return
    except PackageNotFoundError:
        return
    flags = _os.environ.get("XLA_FLAGS", "")
    for flag in ("--xla_cpu_experimental_xnn_fusion_type=", "--xla_cpu_experimental_ynn_fusion_type=",
                 "--xla_cpu_enable_concurrency_optimized_scheduler=false", "--xla_cpu_multi_thread_eigen=false"):
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    _os.environ["XLA_FLAGS"] = flags


_cpu_workaround()

from .config import ConfigError, ModelConfig, load_config  # noqa: E402
from .engine import DEFAULT_MODEL, Engine, load  # noqa: E402

__all__ = ["ConfigError", "DEFAULT_MODEL", "Engine", "ModelConfig", "load", "load_config"]
__version__ = "0.1.0"
