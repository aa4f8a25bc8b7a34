"""The environment a run trained in (versions, device), recorded in its summary.json and shown
in its report, so numbers can be traced to the software and hardware that produced them."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any

# distributions whose versions change numbers or speed (absent ones are left out)
PACKAGES = ("torch", "triton", "numpy", "timm", "spikingjelly", "snntorch", "safetensors")


def environment(device: Any = None) -> dict[str, Any]:
    """Versions of Python, efficient and `PACKAGES`, the OS, CPU cores, torch threads, and the
    device (with the GPU's name and CUDA version when it is one)."""
    import torch

    from efficient import __version__

    env: dict[str, Any] = {
        "efficient": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    for name in PACKAGES:
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    dev = torch.device(device) if device is not None else torch.device("cpu")
    env["device"] = str(dev)
    if dev.type == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["cuda"] = torch.version.cuda
    return env
