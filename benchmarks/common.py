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


def missing_devices(*devices: str, num_gpus_needed: int = 0) -> str | None:
    """Why this machine cannot run a benchmark on `devices` (CUDA absent, too few GPUs), or None."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda = [torch.device(d) for d in devices if str(d).startswith("cuda")]
    needed = max([num_gpus_needed, *((d.index or 0) + 1 for d in cuda)])
    if needed > count:
        return f"needs {needed} CUDA device{'s' * (needed > 1)}, found {count}"
    return None


def exit_if_missing(benchmark: str, *devices: str, num_gpus_needed: int = 0, out=None) -> None:
    """Print a JSON object saying what hardware is missing and exit 0, when it is missing: a
    benchmark that cannot run here says so instead of crashing."""
    import json
    import sys

    reason = missing_devices(*devices, num_gpus_needed=num_gpus_needed)
    if reason is not None:
        (out or sys.stdout).write(json.dumps({"benchmark": benchmark, "skipped": reason}) + "\n")
        raise SystemExit(0)
