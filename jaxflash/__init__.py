"""jaxflash: run qwen4_exp (Qwen3.8-Flash-Next) on one GPU that cannot hold its experts.

    import jaxflash
    engine = jaxflash.load()                 # the bundled model; or jaxflash.load("checkpoint/dir")
    logits = engine.logits([1, 2, 3])

The functional model for JAX research code is `jaxflash.model` (see README.md).
"""

from .config import ConfigError, ModelConfig, load_config
from .engine import DEFAULT_MODEL, Engine, load

__all__ = ["ConfigError", "DEFAULT_MODEL", "Engine", "ModelConfig", "load", "load_config"]
__version__ = "0.1.0"
