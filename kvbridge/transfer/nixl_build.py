"""Which NIXL build this process uses, found without importing torch or NIXL.

kvbridge depends on one build, `nixl-cu12`: its UCX backend runs on CUDA 12 and newer drivers, and
CPU-only over shared memory and TCP. It does not depend on the `nixl` meta package, which installs
both CUDA builds (`nixl-cu12` and `nixl-cu13`, about 430 MB of CUDA libraries) on every machine,
a CPU-only one included. `pip install "kvbridge[cu13]"` adds the CUDA 13 build. Where the `nixl`
meta package is installed anyway (vLLM depends on it), its own choice is used.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

BUILDS = ("nixl_cu12", "nixl_cu13", "nixl_rocm")  # the modules of the nixl-cu12, nixl-cu13, nixl_rocm wheels
META = "nixl"  # the meta package: it picks one of BUILDS itself


def _torch_cuda_major() -> int | None:
    """The CUDA major version of a torch this process has already imported (never imports it)."""
    torch = sys.modules.get("torch")
    version = getattr(getattr(torch, "version", None), "cuda", None)
    return int(version.split(".")[0]) if version else None


def find_build() -> str | None:
    """The module `nixl_api()` imports `_api` from: the meta package when installed, else the build
    that matches torch's CUDA (when torch is imported and a CUDA build), else the first build
    installed; None when there is none. Raises ImportError, as the meta package does, for a CUDA
    torch whose NIXL build is missing: a build for another CUDA major version is not used silently."""
    if importlib.util.find_spec(META) is not None:
        return META
    major = _torch_cuda_major()
    if major is not None:
        if importlib.util.find_spec(f"nixl_cu{major}") is None:
            raise ImportError(
                f"torch is a CUDA {major} build but NIXL's CUDA {major} build is not installed: "
                f"`pip install nixl-cu{major}`" + (' (or `pip install "kvbridge[cu13]"`)' if major == 13 else "")
            )
        return f"nixl_cu{major}"
    for name in BUILDS:
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def is_available() -> bool:
    try:
        return find_build() is not None
    except ImportError:
        return False


def nixl_api() -> ModuleType:
    """NIXL's Python API module (`nixl_agent`, `nixl_agent_config`, `nixlBind`, ...). Raises
    ImportError when no build is installed or the one found cannot be loaded."""
    name = find_build()
    if name is None:
        raise ImportError(
            f"no NIXL build is installed (none of {', '.join((META, *BUILDS))}): `pip install nixl-cu12` (CPU-only "
            'and CUDA 12), or `pip install "kvbridge[cu13]"` (CUDA 13)'
        )
    return importlib.import_module(f"{name}._api")
