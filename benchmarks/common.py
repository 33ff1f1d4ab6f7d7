"""What every benchmark reports about the machine and the software it ran on (docs/benchmarks.md)."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine_info(*devices: str) -> dict:
    """CPU model and count, platform, torch threads, UCX_TLS, and the GPUs when a device is CUDA."""
    import torch

    info = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
    }
    if any(str(d).startswith("cuda") for d in devices):
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def versions() -> dict:
    """Python, torch, and the NIXL and kvbridge packages that are installed."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("nixl", "nixl-cu12", "nixl-cu13", "kvbridge"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out
