"""Token accounting of one scheduler: what the model computed and what it was spared."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SchedulerStats:
    """Monotonic counters since the engine started. `get_stats()` reports them."""

    num_steps: int = 0
    num_computed_tokens: int = 0  # tokens the model computed (prefill chunks, decodes, recomputes)
    num_generated_tokens: int = 0  # tokens sampled
    num_admissions: int = 0
    num_prefix_hit_tokens: int = 0  # prompt tokens served by the local prefix cache at admission
    num_external_tokens: int = 0  # prompt tokens a connector provided at admission
    num_preemptions: int = 0
    num_finished_requests: int = 0
    num_failed_load_blocks: int = 0  # blocks a connector reported as not loaded
    num_load_recomputes: int = 0  # requests rolled back after a failed load (policy `recompute`)
    num_load_failures: int = 0  # requests failed after a failed load (policy `fail`)
    num_async_steps: int = 0  # steps scheduled while the step before was still on the device

    def record_admission(self, num_local: int, num_external: int) -> None:
        self.num_admissions += 1
        self.num_prefix_hit_tokens += num_local
        self.num_external_tokens += num_external

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
