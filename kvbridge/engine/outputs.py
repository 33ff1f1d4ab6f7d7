"""What one engine step passes between the scheduler, the model runner and the connector."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from kvbridge.connectors.base import KVConnectorMetadata
    from kvbridge.engine.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens) are computed."""

    request: Request  # the scheduler's object; the model runner and connectors read it, never mutate it
    start: int  # request.num_computed_tokens before this step
    num_new_tokens: int
    block_ids: list[int]  # every block the request holds, in token order, after this step's allocation


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests that finished or were aborted since the last step: per-request worker state can go.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class KVConnectorOutput:
    """What the worker-side connector reports back to the scheduler after a step."""

    finished_sending: set[str] = field(default_factory=set)  # delay-freed blocks may now be freed
    finished_recving: set[str] = field(default_factory=set)  # async loads done: the request may run
    invalid_block_ids: set[int] = field(default_factory=set)  # blocks whose load failed
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


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
    error: str | None = None
