from __future__ import annotations

import importlib.util

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    has_cuda = _has_cuda()
    has_nixl = importlib.util.find_spec("nixl") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "nixl" in item.keywords and not has_nixl:
            item.add_marker(pytest.mark.skip(reason="needs NIXL: pip install nixl"))
