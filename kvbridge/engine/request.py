"""One request's state as the scheduler sees it.

Its status values are the connector contract's `RequestStatus`: connectors read them too.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvbridge.block_hash import BlockHash, hash_full_blocks
from kvbridge.connectors.base import RequestStatus
from kvbridge.engine.outputs import TokenLogprobs
from kvbridge.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvbridge.engine.tokenizer import TextStream


class Request:
    """Token ids, progress and the chained hashes of every full block of the request."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        block_size: int,
        kv_transfer_params: dict[str, Any] | None = None,
        hash_namespace: str = "",
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.kv_transfer_params = kv_transfer_params
        self.hash_namespace = hash_namespace
        self.arrival_time = time.monotonic()

        self.output_token_ids: list[int] = []
        self.output_logprobs: list[TokenLogprobs] = []  # one per output token, if the params ask for them
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the local prefix cache
        self.num_external_tokens = 0  # prompt tokens served by a connector
        self.num_failed_load_blocks = 0  # blocks a connector failed to load for it (recomputed or failed)
        self.kv_load_error: str | None = None  # why the last failed load failed, as the connector said
        self.kv_external_source: str | None = None  # where its external tokens came from ("peer", "host_tier", ...)
        self.num_preemptions = 0
        self.error: str | None = None
        self.text_stream: TextStream | None = None  # its output decoded so far (EngineCore)
        self.block_hashes: list[BlockHash] = hash_full_blocks(
            self.prompt_token_ids, block_size, namespace=hash_namespace
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def prompt_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Chained hashes of the prompt's full blocks of `block_size` tokens (another engine's blocks)."""
        if block_size == self.block_size:
            return self.block_hashes[: self.num_prompt_tokens // block_size]
        return hash_full_blocks(self.prompt_token_ids, block_size, namespace=self.hash_namespace)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        if self.num_tokens % self.block_size == 0:
            self.block_hashes = hash_full_blocks(
                self.all_token_ids, self.block_size, self.block_hashes, self.hash_namespace
            )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
