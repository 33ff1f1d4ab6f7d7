"""Which vLLM requests may share KV: everything vLLM's own prefix-cache keys cover, in kvbridge's hashes.

vLLM keys a block by its tokens and the block's *extra keys*: the request's LoRA adapter, the
multimodal inputs whose placeholders overlap the block (by content hash), the cache salt (first
block; it then chains into every later block) and a hash of the block's prompt embeddings. Two
requests whose tokens agree but whose extra keys differ must not share KV, in vLLM's prefix cache
or through kvbridge (an offload tier, a P/D read).

kvbridge's chained block hash (`kvbridge.block_hash`) folds in the same extra keys, computed by
vLLM's own `generate_block_hash_extra_keys` (present, with that signature, in 0.25 and 0.32) and
encoded canonically with msgpack. vLLM's request block hashes themselves are not used: their root
(`NONE_HASH`) is random per process unless PYTHONHASHSEED is set, so two engines would disagree on
every hash. A block without extra keys hashes as its tokens alone, as in kvbridge's own engine.

A request whose extra keys cannot be computed or encoded (another vLLM's function, a key of a
type msgpack refuses) is not identifiable: the adapter keeps it away from the kvbridge connector
(no load, no store, no lease), so vLLM computes it locally. Pure bookkeeping: vLLM's function is
imported by the caller and passed in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

ExtraKeysFn = Callable[[Any, int, int, int], tuple[Any, int]]  # (request, start, end, mm index) -> (keys, next index)

_ENCODER = msgspec.msgpack.Encoder()


class UnidentifiableRequest(Exception):
    """The request's KV depends on something kvbridge cannot name: it must be computed locally."""


def vllm_extra_keys_fn() -> ExtraKeysFn | None:
    """vLLM's `generate_block_hash_extra_keys`, or None where this vLLM has none."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    except ImportError:
        return None
    return generate_block_hash_extra_keys


def has_extra_identity(request: Any) -> bool:
    """Whether anything but the tokens can decide this request's KV (vLLM's extra-key inputs)."""
    return bool(
        getattr(request, "cache_salt", None)
        or getattr(request, "lora_request", None)
        or getattr(request, "mm_features", None)
        or getattr(request, "prompt_embeds", None) is not None
    )


class BlockExtraKeys:
    """Per-block extra-key bytes of one request, block by block as it grows (vLLM walks the multimodal
    inputs in order, so the index of the next one is carried from block to block)."""

    __slots__ = ("_fn", "_next_mm")

    def __init__(self, fn: ExtraKeysFn | None) -> None:
        self._fn = fn
        self._next_mm = 0

    def of_block(self, request: Any, start: int, end: int) -> bytes | None:
        if self._fn is None:
            raise UnidentifiableRequest("this vLLM has no generate_block_hash_extra_keys")
        try:
            keys, self._next_mm = self._fn(request, start, end, self._next_mm)
            return None if keys is None else _ENCODER.encode(keys)
        except Exception as exc:  # noqa: BLE001 - any failure means: not identifiable, compute locally
            raise UnidentifiableRequest(f"{type(exc).__name__}: {exc}") from exc
