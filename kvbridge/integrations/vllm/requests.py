"""vLLM's scheduler objects seen through kvbridge's connector API, without copying KV or tokens.

kvbridge's scheduler halves read a request's id, token counts, `kv_transfer_params`, status and
the chained block hashes (`kvbridge.block_hash`: the identity of KV in every kvbridge
engine, so a vLLM node and a kvbridge node agree on which blocks hold which prompt). vLLM's
`Request` has all of it but the hashes, which `RequestView` computes from the token ids and the
extra keys vLLM's prefix cache uses (`identity.py`: cache salt, LoRA, multimodal inputs, prompt
embeddings), a block at a time as the request grows. `step_output` turns vLLM's
`SchedulerOutput` into kvbridge's.

Pure bookkeeping: no torch, and vLLM's objects are only read (duck-typed, so the tests can drive
it without an engine).
"""

from __future__ import annotations

from typing import Any

from kvbridge.block_hash import BlockHash, hash_block, hash_full_blocks, root_hash
from kvbridge.connectors.base import RequestStatus, ScheduledRequest, SchedulerOutput
from kvbridge.integrations.vllm.identity import BlockExtraKeys, ExtraKeysFn, has_extra_identity

# vLLM's finished statuses -> kvbridge's (vLLM's RequestStatus is an IntEnum; compared by name so
# that this module does not import vLLM). Anything not listed and not finished is RUNNING enough
# for a connector: connectors only tell "finished normally" from the rest.
_FINISHED = {
    "FINISHED_STOPPED": RequestStatus.FINISHED_STOPPED,
    "FINISHED_LENGTH_CAPPED": RequestStatus.FINISHED_LENGTH,
    "FINISHED_REPETITION": RequestStatus.FINISHED_STOPPED,
    "FINISHED_ABORTED": RequestStatus.FINISHED_ABORTED,
    "FINISHED_IGNORED": RequestStatus.FINISHED_ABORTED,
    "FINISHED_ERROR": RequestStatus.FINISHED_ERROR,
}
_UNFINISHED = {
    "WAITING": RequestStatus.WAITING,
    "WAITING_FOR_REMOTE_KVS": RequestStatus.WAITING_FOR_REMOTE_KVS,
    "PREEMPTED": RequestStatus.PREEMPTED,
}


class RequestView:
    """One vLLM request as a kvbridge `Request` (the attributes connectors read)."""

    __slots__ = ("_req", "block_size", "hash_namespace", "_hashes", "_next_mm", "_extra")

    def __init__(self, vllm_request: Any, block_size: int, hash_namespace: str, extra_keys: ExtraKeysFn | None) -> None:
        self._req = vllm_request
        self.block_size = block_size
        self.hash_namespace = hash_namespace
        self._hashes: list[BlockHash] = []
        self._next_mm = 0  # the multimodal input the next block of `_hashes` starts looking at
        # Requests whose KV only their tokens decide (most) hash as in kvbridge's engine, without vLLM's help.
        self._extra = BlockExtraKeys(extra_keys) if has_extra_identity(vllm_request) else None

    @property
    def request_id(self) -> str:
        return self._req.request_id

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        return self._req.kv_transfer_params

    @property
    def num_prompt_tokens(self) -> int:
        return self._req.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self._req.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self._req.num_computed_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return list(self._req.all_token_ids)

    @property
    def status(self) -> RequestStatus:
        name = self._req.status.name
        return _FINISHED.get(name) or _UNFINISHED.get(name, RequestStatus.RUNNING)

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Chained hashes of every full block of the request's tokens so far, computed once each.
        Raises `UnidentifiableRequest` when vLLM's extra keys of a block cannot be had."""
        num_full = self._req.num_tokens // self.block_size
        if len(self._hashes) < num_full:
            self._hashes, self._next_mm = self._chain(self._req.num_tokens, self.block_size, self._hashes, self._next_mm)
        return self._hashes

    def prompt_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Chained hashes of the prompt's full blocks of `block_size` tokens (another engine's blocks)."""
        if block_size == self.block_size:
            return self.block_hashes[: self._req.num_prompt_tokens // block_size]
        return self._chain(self._req.num_prompt_tokens, block_size, [], 0)[0]  # a chain of its own: from the first input

    def _chain(
        self, num_tokens: int, block_size: int, known: list[BlockHash], next_mm: int
    ) -> tuple[list[BlockHash], int]:
        """`known` (whose next block looks at multimodal input `next_mm` first) extended to the full blocks
        of the first `num_tokens` tokens, and the input the block after them starts at. Extended only
        once every new block's extra keys are known: `UnidentifiableRequest` otherwise."""
        num_full = num_tokens // block_size
        tokens = self._req.all_token_ids[: num_full * block_size]
        if self._extra is None:
            return hash_full_blocks(tokens, block_size, known, self.hash_namespace), next_mm
        hashes = list(known)
        for start in range(len(hashes) * block_size, num_full * block_size, block_size):
            parent = hashes[-1] if hashes else root_hash(self.hash_namespace)
            end = start + block_size
            keys, next_mm = self._extra.of_block(self._req, start, end, next_mm)
            hashes.append(hash_block(parent, tokens[start:end], keys))
        return hashes, next_mm

    def __repr__(self) -> str:
        return f"RequestView({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"


class RequestViews:
    """The view of every request the scheduler half knows, by id, made on first sight."""

    def __init__(self, block_size: int, hash_namespace: str, extra_keys: ExtraKeysFn | None = None) -> None:
        self.block_size = block_size
        self.hash_namespace = hash_namespace
        self.extra_keys = extra_keys  # vLLM's generate_block_hash_extra_keys (identity.py)
        self._views: dict[str, RequestView] = {}

    def of(self, vllm_request: Any) -> RequestView:
        view = self._views.get(vllm_request.request_id)
        if view is None or view._req is not vllm_request:  # a new request object under a reused id
            view = RequestView(vllm_request, self.block_size, self.hash_namespace, self.extra_keys)
            self._views[vllm_request.request_id] = view
        return view

    def get(self, request_id: str) -> RequestView | None:
        return self._views.get(request_id)

    def drop(self, request_id: str) -> None:
        self._views.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._views)


def first_group(block_ids: Any) -> list[int]:
    """vLLM's block ids are one list per KV cache group; kvbridge connectors run with exactly one."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return list(block_ids[0])
    return list(block_ids or ())


class BlockTables:
    """Each running request's block table, rebuilt from vLLM's per-step deltas where vLLM does not
    hand connectors whole tables (0.25: `scheduled_new_reqs[*].block_ids`, then
    `scheduled_cached_reqs.new_block_ids` appended, or replacing the table of a resumed request)."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def apply(self, vllm_output: Any) -> None:
        for new in vllm_output.scheduled_new_reqs:
            self._tables[new.req_id] = first_group(new.block_ids)
        cached = vllm_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if req_id in resumed:
                self._tables[req_id] = first_group(new_ids)
            elif new_ids is not None:
                self._tables.setdefault(req_id, []).extend(first_group(new_ids))
        for req_id in vllm_output.finished_req_ids:
            self._tables.pop(req_id, None)

    def get(self, req_id: str) -> list[int]:
        return list(self._tables.get(req_id, ()))


def step_output(vllm_output: Any, views: RequestViews, tables: BlockTables) -> SchedulerOutput:
    """kvbridge's `SchedulerOutput` for one vLLM step: every scheduled request with its progress
    and its whole block table, and the finished and preempted ids."""
    block_state = getattr(vllm_output, "kv_connector_block_state", None)  # vLLM 0.32; absent in 0.25
    if block_state is None:
        tables.apply(vllm_output)
    start_of: dict[str, int] = {new.req_id: new.num_computed_tokens for new in vllm_output.scheduled_new_reqs}
    cached = vllm_output.scheduled_cached_reqs
    start_of.update(zip(cached.req_ids, cached.num_computed_tokens))
    scheduled = []
    for req_id, num_new_tokens in vllm_output.num_scheduled_tokens.items():
        view = views.get(req_id)
        if view is None:  # never offered to the connector (vLLM skips it for some requests): nothing to plan
            continue
        block_ids = first_group(block_state.get_block_ids(req_id)) if block_state is not None else tables.get(req_id)
        scheduled.append(ScheduledRequest(view, start_of.get(req_id, view.num_computed_tokens), num_new_tokens, block_ids))
    return SchedulerOutput(
        scheduled=scheduled,
        finished_req_ids=set(vllm_output.finished_req_ids),
        preempted_req_ids=set(getattr(vllm_output, "preempted_req_ids", None) or ()),
        runs_model=vllm_output.total_num_scheduled_tokens > 0,
    )
