"""What the model runner returns for a step, and what the engine returns for each request.

The step types a connector sees as well (`SchedulerOutput`, `KVConnectorOutput`) belong to the
connector contract and live in `kvbridge/connectors/base.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbridge.connectors.base import KVConnectorOutput


@dataclass
class ModelRunnerOutput:
    # One sampled token for each request whose step reached the end of its known tokens
    # (a chunked prefill that has not reached the end samples nothing).
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput = field(default_factory=KVConnectorOutput)
    # Requests whose share of the step failed (e.g. sampling), with the reason: the scheduler ends them.
    request_errors: dict[str, str] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]  # every generated token so far
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running


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
