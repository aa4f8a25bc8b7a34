"""efficient: neuromorphic and efficient models for PyTorch.

    import efficient
    model = efficient.load("spikformer-4-384")
    efficient.list_models("spikformer*")
"""

from __future__ import annotations

from efficient.accelerate import accelerate  # the function shadows its module's name, on purpose
from efficient.checks import check
from efficient.errors import ConfigError, DataError
from efficient.hf import early_exit
from efficient.zoo import list_models, load, register_model

__version__ = "0.1.0"

__all__ = ["ConfigError", "DataError", "accelerate", "check", "fold_batchnorm", "list_models", "load", "register_model", "__version__"]


def __getattr__(name: str):
    # `efficient.profile` (the profiler package) and `efficient.fold_batchnorm` are imported on first use.
    if name == "profile":
        from efficient.profiler import profile

        return profile
    if name == "fold_batchnorm":  # imports the kernels: on first use only
        from efficient.batchnorm_fold import fold_batchnorm

        return fold_batchnorm
    raise AttributeError(f"module 'efficient' has no attribute {name!r}")
