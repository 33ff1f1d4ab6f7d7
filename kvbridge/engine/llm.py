"""`LLM`: the offline front end. Builds one `EngineCore`, runs batches of prompts to completion.

    with LLM() as llm:                                   # the built-in `tiny` model, on CPU
        out = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0))
        print(out[0].text, out[0].token_ids)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, Union

from kvbridge.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig
from kvbridge.engine.core import EngineCore
from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.errors import ConfigError, EngineStalledError, InvalidRequestError
from kvbridge.transfer.progress import Backoff

Prompt = Union[str, dict[str, Any]]  # text, or {"prompt_token_ids": [...]}

STALL_GRACE_S = 30.0  # added to the flush timeout before a request making no progress is an error


class LLM:
    """One engine and a blocking `generate`. `llm.engine` is the `EngineCore`."""

    def __init__(
        self,
        model: str = "tiny",
        dtype: str = "float32",
        device: str = "cpu",
        *,
        seed: int = 0,
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_fraction: float | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        async_scheduling: bool | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        kv_transfer_config: KVTransferConfig | dict | None = None,
    ) -> None:
        if isinstance(kv_transfer_config, dict):
            kv_transfer_config = KVTransferConfig(**kv_transfer_config)
        self.config = EngineConfig(
            model=ModelConfig(
                model=model,
                dtype=dtype,
                device=device,
                seed=seed,
                max_model_len=max_model_len,
                enforce_eager=enforce_eager,
                tensor_parallel_size=tensor_parallel_size,
            ),
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                memory_fraction=memory_fraction,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                async_scheduling=async_scheduling,
            ),
            kv_transfer=kv_transfer_config,
        )
        self.engine = EngineCore(self.config)
        self._ids = itertools.count()
        # generate() raises EngineStalledError after this long without any step computing anything.
        self.stall_timeout_s = STALL_GRACE_S + self.engine.flush_timeout_s

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        kv_transfer_params: dict | Sequence[dict | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order, finished.

        `prompts`: a string, `{"prompt_token_ids": [...]}`, or a list of those. `sampling_params`: one
        for all, or one per prompt (default `SamplingParams()`).
        """
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = _per_prompt(sampling_params or SamplingParams(), len(prompt_list), "sampling_params")
        kv_params_list = _per_prompt(kv_transfer_params, len(prompt_list), "kv_transfer_params")
        request_ids = [f"llm-{next(self._ids)}" for _ in prompt_list]
        try:
            for request_id, prompt, params, kv_params in zip(request_ids, prompt_list, params_list, kv_params_list):
                self.engine.add_request(request_id, self._token_ids(prompt), params, kv_params)
            finished = self._run_until_done(set(request_ids))
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        return [finished[r] for r in request_ids]

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return [int(t) for t in prompt["prompt_token_ids"]]
        raise InvalidRequestError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def _run_until_done(self, request_ids: set[str]) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        stall_limit_s = self.stall_timeout_s
        last_progress = time.monotonic()
        backoff = Backoff()  # steps that compute nothing wait on transfers: ever longer, up to a cap
        while len(finished) < len(request_ids):
            outputs = self.engine.step()
            for output in outputs:
                if output.finished and output.request_id in request_ids:
                    finished[output.request_id] = output
            if not self.engine.is_idle or outputs:
                last_progress = time.monotonic()
                backoff.reset()
                continue
            if time.monotonic() - last_progress > stall_limit_s:
                pending = sorted(request_ids - set(finished))
                raise EngineStalledError(
                    f"requests {pending} made no progress for {stall_limit_s:g} s (waiting on KV transfers "
                    f"or blocks); check the connector's peer, or raise KVTransferConfig.flush_timeout_s"
                )
            self.engine.wait_for_work(backoff.next_s())
        return finished

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes (after in-flight transfers finished; see EngineCore.reset_prefix_cache)."""
        return self.engine.reset_prefix_cache()

    def get_stats(self) -> dict:
        return self.engine.get_stats()

    def shutdown(self) -> None:
        """Release the model, the KV cache and the connector. Idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(f"{name}: got {len(value)} values for {n} prompts; give one, or one per prompt")
        return list(value)
    return [value] * n
