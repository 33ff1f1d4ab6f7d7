"""What the model runner returns for a step, and what the engine returns for each request.

The step types a connector sees as well (`SchedulerOutput`, `KVConnectorOutput`) belong to the
connector contract and live in `kvbridge/connectors/base.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvbridge.connectors.base import KVConnectorOutput


class TokenLogprobs(NamedTuple):
    """A sampled token's log-probability and the `SamplingParams.logprobs` most likely tokens', most
    likely first (the sampled token among them only if it is one of those)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob)


@dataclass
class ModelRunnerOutput:
    # One sampled token for each request whose step reached the end of its known tokens
    # (a chunked prefill that has not reached the end samples nothing).
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput = field(default_factory=KVConnectorOutput)
    # Requests whose share of the step failed (e.g. sampling), with the reason: the scheduler ends them.
    request_errors: dict[str, str] = field(default_factory=dict)
    # The sampled token's logprobs, for the requests whose SamplingParams.logprobs is set.
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]  # every generated token so far
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when SamplingParams.logprobs is set


@dataclass
class RequestOutput:
    """What `EngineCore.step()` returns for a request that progressed, and what `LLM.generate` returns."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    kv_transfer_params: dict[str, Any] | None = None  # set by the connector when the request finishes
    num_cached_tokens: int = 0  # prompt tokens served by the local prefix cache
    num_external_tokens: int = 0  # prompt tokens served by a connector
    num_failed_load_blocks: int = 0  # blocks a connector failed to load (recomputed, or the request failed)
    kv_load_error: str | None = None  # why the last failed load failed, as the connector said
    kv_external_source: str | None = None  # where num_external_tokens came from: "peer", "host_tier", "disk_tier", ...
    error: str | None = None
