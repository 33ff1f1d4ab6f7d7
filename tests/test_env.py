from __future__ import annotations

import pytest

from kvbridge import env


@pytest.mark.parametrize(
    ("conf", "expected"),
    [("", False), ("expandable_segments:False", False), ("max_split_size_mb:64, expandable_segments:True", True)],
)
def test_expandable_segments_are_detected(monkeypatch, conf, expected):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert env.torch_uses_expandable_segments() is expected


def test_numbers_from_the_environment_are_checked(monkeypatch):
    monkeypatch.setenv("KVBRIDGE_FLUSH_TIMEOUT_S", "2.5")
    assert env.flush_timeout_s() == 2.5
    monkeypatch.setenv("KVBRIDGE_FLUSH_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="KVBRIDGE_FLUSH_TIMEOUT_S"):
        env.flush_timeout_s()
