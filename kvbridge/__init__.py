"""kvbridge: move LLM KV cache between inference engines and memory tiers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbridge.engine.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from kvbridge.engine.llm import LLM


def __getattr__(name: str):
    # LLM imports torch; keep `import kvbridge` light for bookkeeping-only users.
    if name == "LLM":
        from kvbridge.engine.llm import LLM

        return LLM
    raise AttributeError(name)
