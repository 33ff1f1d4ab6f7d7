"""How to sample a completion, and the range of every value (the HTTP API's 400s come from here).

Checks that need the model (token ids below the vocabulary size, `max_tokens` within
`max_model_len`) are `EngineCore.add_request`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvbridge.errors import SamplingParamsError

# Below 0.01, logits / temperature overflow float32 and softmax gives NaN (1e-300 did, and killed the
# engine). Such a temperature is greedy in all but name: send 0.
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 100.0  # far past uniform sampling already
MAX_TOP_K = (1 << 31) - 1  # any k >= the vocabulary size means no cut
MAX_SEED = (1 << 64) - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed
MAX_TOKEN_ID = (1 << 63) - 1  # token ids travel as int64 tensors
# The scheduler checks every sampled token against them; 4M of them slowed every other request to 28 s.
MAX_STOP_TOKEN_IDS = 1024
MAX_ABS_PENALTY = 2.0  # presence and frequency penalties, OpenAI's range
# repetition_penalty divides positive logits (multiplies negative ones): far outside this, a repeated
# token is certain or impossible already, and the extremes only risk overflow.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_LOGPROBS = 20  # alternatives per token, OpenAI's chat limit (its completions API allows 5)


def _check(ok: bool, name: str, expected: str, value: object) -> None:
    if not ok:
        raise SamplingParamsError(f"SamplingParams.{name} must be {expected}, got {value!r}", name)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. `seed` makes a sampled completion reproducible per request.

    Raises SamplingParamsError (a ConfigError) naming the first value out of range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # OpenAI's penalties, on the output so far: logit -= presence * (count > 0) + frequency * count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's / transformers', on the prompt and the output: a seen token's logit / p if > 0, else * p.
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # until this many are generated, EOS and stop_token_ids cannot be sampled
    # None: no log-probabilities (nothing computed). N: each sampled token's logprob and the N most
    # likely tokens', all from the model's raw logits (engine/sampler.py, `token_logprobs`).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        t = self.temperature
        _check(self.max_tokens >= 1, "max_tokens", "at least 1", self.max_tokens)
        _check(
            t == 0 or (math.isfinite(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE),
            "temperature", f"0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]", t,
        )  # fmt: skip
        _check(math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(0 <= self.top_k <= MAX_TOP_K, "top_k", f"in [0, {MAX_TOP_K}] (0: no cut)", self.top_k)
        _check(self.seed is None or 0 <= self.seed <= MAX_SEED, "seed", "in [0, 2**64 - 1]", self.seed)
        num_stop = len(self.stop_token_ids)
        _check(num_stop <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids", num_stop)
        bad = next((t for t in self.stop_token_ids if not 0 <= t <= MAX_TOKEN_ID), None)
        _check(bad is None, "stop_token_ids", "token ids >= 0", bad)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            in_range = math.isfinite(value) and abs(value) <= MAX_ABS_PENALTY
            _check(in_range, name, f"in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}]", value)
        rp = self.repetition_penalty
        _check(
            math.isfinite(rp) and MIN_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY,
            "repetition_penalty", f"in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] (1: none)", rp,
        )  # fmt: skip
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "in [0, max_tokens]", self.min_tokens)
        lp = self.logprobs
        _check(lp is None or 0 <= lp <= MAX_LOGPROBS, "logprobs", f"None or in [0, {MAX_LOGPROBS}]", lp)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_token_history(self) -> bool:
        """The sampler must see the request's tokens (penalties, min_tokens)."""
        return self.has_penalties or self.min_tokens > 0
