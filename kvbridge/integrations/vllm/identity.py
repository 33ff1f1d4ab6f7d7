"""Which vLLM requests may share KV: everything vLLM's own prefix-cache keys cover, in kvbridge's hashes.

vLLM keys a block by its tokens and the block's *extra keys*: the request's LoRA adapter, the
multimodal inputs whose placeholders overlap the block (by content hash), the cache salt (first
block; it then chains into every later block) and a hash of the block's prompt embeddings. kvbridge
adds the LoRA adapter's content (`adapter_digest`), which vLLM's keys (its name and path) miss. Two
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

import hashlib
import logging
import os
import stat
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
    """Per-block extra-key bytes of one request. vLLM walks the multimodal inputs in order, so each
    call takes the index of the next one and returns it for the next block: a chain that restarts
    (another engine's block size) restarts it at 0. The LoRA adapter's content (`adapter_digest`)
    joins the first block's keys, and so, through the chain, every block's."""

    __slots__ = ("_fn", "_adapter")

    def __init__(self, fn: ExtraKeysFn | None) -> None:
        self._fn = fn
        self._adapter: bytes | None = None  # the request's adapter digest, computed once

    def of_block(self, request: Any, start: int, end: int, next_mm: int) -> tuple[bytes | None, int]:
        """(this block's extra-key bytes or None, the index of the next multimodal input)."""
        if self._fn is None:
            raise UnidentifiableRequest("this vLLM has no generate_block_hash_extra_keys")
        try:
            keys, next_mm = self._fn(request, start, end, next_mm)
        except Exception as exc:  # noqa: BLE001 - any failure means: not identifiable, compute locally
            raise UnidentifiableRequest(f"{type(exc).__name__}: {exc}") from exc
        lora = getattr(request, "lora_request", None)
        if start == 0 and lora:
            if self._adapter is None:
                self._adapter = adapter_digest(getattr(lora, "lora_path", "") or "")
            keys = (*(keys or ()), ("lora_content", self._adapter))
        try:
            return (None if keys is None else _ENCODER.encode(keys)), next_mm
        except Exception as exc:  # noqa: BLE001
            raise UnidentifiableRequest(f"{type(exc).__name__}: {exc}") from exc


# ---------------------------------------------------------------------- LoRA adapters by content

_ADAPTER_CHUNK_NBYTES = 1 << 20
_adapter_digests: dict[str, tuple[tuple, bytes]] = {}  # path -> (the files' stat signature, digest)


def adapter_digest(path: str) -> bytes:
    """SHA-256 of a LoRA adapter's files (every regular file under `path`, by relative name, with its
    length and bytes). Read once per adapter version: cached under the files' names, sizes,
    modification times and inode numbers, re-checked (stat only) at each request.

    Content rather than path and modification time: nodes on other hosts that hold the same adapter
    (copied, with new modification times) agree on its KV, which P/D and a shared offload tier need;
    and an adapter rewritten in place within the file system's timestamp granularity, or replaced by
    a copy that kept the old times (`cp -p`, `rsync -t`, an image layer), never shares KV with its
    former self. The cost, one read of the adapter when it first appears or changes, is small next to
    vLLM loading the same weights. Raises UnidentifiableRequest for a path that is not a local file
    or directory (a hub id resolved elsewhere): such a request is computed locally.
    """
    root = os.path.abspath(path) if path else ""
    try:
        files = _adapter_files(root)
        signature = tuple((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in files)
    except OSError as exc:
        raise UnidentifiableRequest(f"LoRA adapter path {path!r} is not a local file or directory: {exc}") from exc
    cached = _adapter_digests.get(root)
    if cached is not None and cached[0] == signature:
        return cached[1]
    digest = hashlib.sha256()
    try:
        for name, _ in files:
            full = os.path.join(root, name) if name else root
            digest.update(_ENCODER.encode((name, os.path.getsize(full))))
            with open(full, "rb") as f:
                while chunk := f.read(_ADAPTER_CHUNK_NBYTES):
                    digest.update(chunk)
    except OSError as exc:
        raise UnidentifiableRequest(f"LoRA adapter {path!r} cannot be read: {exc}") from exc
    if len(_adapter_digests) >= 64:
        _adapter_digests.clear()
    _adapter_digests[root] = (signature, digest.digest())
    return _adapter_digests[root][1]


def _adapter_files(root: str) -> list[tuple[str, os.stat_result]]:
    """(relative name, stat) of every regular file of the adapter, sorted; ("", stat) for a single file."""
    if not root:
        raise FileNotFoundError("no path")
    st = os.stat(root)
    if stat.S_ISREG(st.st_mode):
        return [("", st)]
    if not stat.S_ISDIR(st.st_mode):
        raise FileNotFoundError(f"{root} is neither a file nor a directory")
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            full = os.path.join(directory, name)
            st = os.stat(full)
            if stat.S_ISREG(st.st_mode):
                found.append((os.path.relpath(full, root), st))
    return sorted(found, key=lambda item: item[0])
