"""What the conformance kit drives: the connector under test, as the command line names it, on
the reference engine (the tiny model on CPU), and what its results are checked against."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from kvbridge.block_hash import hash_full_blocks
from kvbridge.config import KVTransferConfig
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvbridge.block_hash import BlockHash
    from kvbridge.engine.llm import LLM

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BLOCK_SIZE = 16
NUM_BLOCKS = 64  # room for every prompt of a pass at once, so no block is evicted mid-pass
PROMPT_SEED = 36
PROMPT_LENGTHS = (52, 75, 36)  # 3, 4 and 2 full blocks, each with a partial block after them
# The preemption check: two prompts that fill PREEMPT_NUM_BLOCKS exactly (4 full blocks, then 2 full
# and a partial one); the first one's first decode needs a fifth block, so the second is preempted.
PREEMPT_PROMPT_LENGTHS = (64, 40)
PREEMPT_NUM_BLOCKS = 7
_CONFIG_FIELDS = {f.name for f in fields(KVTransferConfig)} - {"connector"}


def kit_prompts() -> list[list[int]]:
    """The prompts every check serves: distinct, so that no two share a prefix block."""
    rng = random.Random(PROMPT_SEED)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in PROMPT_LENGTHS]


def preempt_prompts() -> list[list[int]]:
    """The prompts of the preemption check (no block in common with `kit_prompts`)."""
    rng = random.Random(PROMPT_SEED + 1)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in PREEMPT_PROMPT_LENGTHS]


def _json_object(text: str | None, option: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{option}: not JSON ({exc}); give a JSON object, e.g. '{{\"extra\": {{...}}}}'") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{option}: expected a JSON object, got {type(value).__name__}")
    return value


def _config_options(text: str | None, option: str) -> dict[str, Any] | None:
    options = _json_object(text, option)
    if options is not None and (unknown := sorted(set(options) - _CONFIG_FIELDS)):
        raise ConfigError(f"{option}: unknown KVTransferConfig field(s) {unknown}; known: {sorted(_CONFIG_FIELDS)}")
    return options


@dataclass(frozen=True)
class ConnectorUnderTest:
    """`name` is a registered connector, an entry point of `kvbridge.connectors` or a "module:Class"
    path; `options` the other KVTransferConfig fields; `failing_options` replace them for the load
    error check (a config under which the connector's loads fail); `first_params` the
    kv_transfer_params of the first pass (the second pass gets what the first returned); `is_pair`:
    a P/D connector, run as a producer engine and a consumer engine (`pair.py`)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    failing_options: dict[str, Any] | None = None
    first_params: dict[str, Any] | None = None
    deadline_grace_s: float = 10.0
    is_pair: bool = False

    def __post_init__(self) -> None:
        if self.is_pair and "role" in self.options:
            raise ConfigError("--kvbridge-pair: the kit gives each engine of the pair its role; leave \"role\" out of "
                              "--kvbridge-connector-config")  # fmt: skip

    @classmethod
    def parse(cls, name: str, config: str | None = None, failing_config: str | None = None,
              first_params: str | None = None, deadline_grace_s: float = 10.0,
              is_pair: bool = False) -> ConnectorUnderTest:  # fmt: skip
        """From the command line's strings; a malformed one is a ConfigError naming its option."""
        return cls(
            name,
            _config_options(config, "--kvbridge-connector-config") or {},
            _config_options(failing_config, "--kvbridge-connector-failing-config"),
            _json_object(first_params, "--kvbridge-first-params"),
            deadline_grace_s,
            is_pair,
        )

    def transfer_config(self, options: dict[str, Any] | None = None, role: str | None = None) -> KVTransferConfig:
        options = self.options if options is None else options
        return KVTransferConfig(connector=self.name, **(options if role is None else {**options, "role": role}))

    def engine(self, options: dict[str, Any] | None = None, num_blocks: int = NUM_BLOCKS,
               role: str | None = None) -> LLM:  # fmt: skip
        """A tiny-model engine on CPU with this connector (`role`: the config's, or this one)."""
        from kvbridge.engine.llm import LLM  # torch, only once an engine is built

        config = self.transfer_config(options, role)
        return LLM(block_size=BLOCK_SIZE, num_blocks=num_blocks, kv_transfer_config=config)


@dataclass(frozen=True)
class Reference:
    """What an engine without a connector computes for the kit's prompts."""

    outputs: list[list[int]]  # greedy token ids per prompt
    kv: dict[BlockHash, torch.Tensor]  # chained hash -> that block's KV, [num_layers, *page_shape]


_REFERENCES: dict[tuple[tuple[int, ...], ...], Reference] = {}


def compute_reference(prompts: list[list[int]]) -> Reference:
    """Computed once per process and set of prompts (the kit may run several times in one process)."""
    key = tuple(tuple(p) for p in prompts)
    if key not in _REFERENCES:
        _REFERENCES[key] = _compute_reference(prompts)
    return _REFERENCES[key]


def _compute_reference(prompts: list[list[int]]) -> Reference:
    from kvbridge.engine.llm import LLM

    with LLM(block_size=BLOCK_SIZE, num_blocks=4 * NUM_BLOCKS) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        pool, kv_cache = llm.engine.scheduler.kv.pool, llm.engine.runner.kv_cache
        kv = {}
        for prompt in prompts:
            for block_hash in hash_full_blocks(prompt, BLOCK_SIZE, namespace=llm.engine.hash_namespace):
                if (block_id := pool.get_cached_block(block_hash)) is not None:
                    kv[block_hash] = kv_cache[block_id].clone()
    return Reference([o.outputs[0].token_ids for o in outputs], kv)
