"""Sizing and allocating the one block-major KV cache tensor."""

from __future__ import annotations

import pytest
import torch

from kvbridge.config import CacheConfig, ModelConfig
from kvbridge.engine import kv_cache
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.presets import get_preset
from kvbridge.errors import ConfigError

TINY = get_preset("tiny")
CPU = torch.device("cpu")


def test_cache_tensor_follows_the_layout():
    runner = ModelRunner(ModelConfig(dtype="bfloat16"), CacheConfig(block_size=8, num_blocks=6))
    layout, kv = runner.layout, runner.kv_cache
    assert layout.shape == (6, TINY.num_layers, 2, 8, TINY.num_kv_heads, TINY.head_dim)
    assert kv.shape == layout.shape and kv.dtype == torch.bfloat16 and layout.dtype == "bfloat16"
    assert kv.is_contiguous() and not kv.any()
    assert kv.numel() * kv.element_size() == layout.total_nbytes
    for block_id in range(layout.num_blocks):  # layout.py's arithmetic is the tensor's truth
        assert kv[block_id].data_ptr() - kv.data_ptr() == layout.block_offset(block_id)
    runner.shutdown()


@pytest.mark.parametrize("block_size,expected", [(16, 512), (64, 128)])
def test_default_holds_8k_tokens(block_size, expected):
    assert kv_cache.num_kv_blocks(CacheConfig(block_size=block_size), 1024, CPU) == expected
    assert expected * block_size == kv_cache.DEFAULT_KV_TOKENS


def test_memory_fraction_of_available_host_memory(monkeypatch):
    monkeypatch.setattr(kv_cache, "available_host_bytes", lambda: 100 * 2**20)
    assert kv_cache.num_kv_blocks(CacheConfig(memory_fraction=0.5), 2**20, CPU) == 50
    monkeypatch.setattr(kv_cache, "available_host_bytes", lambda: 10**15)  # capped on CPU
    assert kv_cache.num_kv_blocks(CacheConfig(memory_fraction=0.5), 2**20, CPU) == kv_cache.CPU_KV_CAP_BYTES // 2**21
    monkeypatch.setattr(kv_cache, "available_host_bytes", lambda: 2**20)
    with pytest.raises(ConfigError, match="raise CacheConfig.memory_fraction"):
        kv_cache.num_kv_blocks(CacheConfig(memory_fraction=0.5), 2**20, CPU)


def test_explicit_block_count_wins():
    assert kv_cache.num_kv_blocks(CacheConfig(num_blocks=3), 10**12, CPU) == 3


def test_max_model_len_is_capped_to_cache_capacity():
    runner = ModelRunner(ModelConfig(), CacheConfig(block_size=16, num_blocks=4))
    assert runner.max_model_len == 64
    runner.shutdown()
    runner = ModelRunner(ModelConfig(max_model_len=100), CacheConfig(num_blocks=64))
    assert runner.max_model_len == 100
    runner.shutdown()
    with pytest.raises(ConfigError, match="exceeds the model's limit"):
        ModelRunner(ModelConfig(max_model_len=TINY.max_position + 1), CacheConfig(num_blocks=4))


def test_cuda_device_without_cuda_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        ModelRunner(ModelConfig(device="cuda"), CacheConfig(num_blocks=4))
