"""The rules of the connector contract that the conformance kit checks, each with the id its
failure messages start with (docs/connector-api.md, "The conformance kit", explains each one)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Rule(enum.Enum):
    """One rule of the contract. `value` is its id, `statement` what a connector must do."""

    PLAIN_METADATA = "plain-metadata"
    FINISH_ONCE = "finish-once"
    LANDED_BEFORE_FINISHED = "landed-before-finished"
    RELEASE_AFTER_TRANSFER = "release-after-transfer"
    FLUSH_WAITS_WITH_DEADLINE = "flush-waits-with-deadline"
    SHUTDOWN_RETURNS_EVERYTHING = "shutdown-returns-everything"
    NEVER_WRONG_OUTPUT = "never-wrong-output"
    CONFIG_REFUSED_AT_CONSTRUCTION = "config-refused-at-construction"

    @property
    def statement(self) -> str:
        return _STATEMENTS[self]


_STATEMENTS = {
    Rule.PLAIN_METADATA: "both halves are built from one config, and the metadata the scheduler half sends its "
    "worker half is plain data that survives a msgspec round trip",
    Rule.FINISH_ONCE: "every load or store a connector starts is reported finished exactly once "
    "(finished_recving / finished_sending), and nothing that never started is reported",
    Rule.LANDED_BEFORE_FINISHED: "a load is reported finished (or a sync load's wait_for_layer_load returns) only once "
    "its bytes are in place in the KV cache",
    Rule.RELEASE_AFTER_TRANSFER: "a request's blocks are reported free (finished_recving after an abort, "
    "finished_sending after a store, start_load_kv returning in the step that preempted it) only once no "
    "transfer reads or writes them any more",
    Rule.FLUSH_WAITS_WITH_DEADLINE: "reset_prefix_cache waits for the transfers in flight and then returns True, "
    "and flush(timeout_s) returns by its deadline",
    Rule.SHUTDOWN_RETURNS_EVERYTHING: "create -> serve -> shutdown in a loop leaves tensors, memory, threads and "
    "file descriptors where they started",
    Rule.NEVER_WRONG_OUTPUT: "a load error becomes a recompute, never wrong output: every completion equals an "
    "engine's without a connector",
    Rule.CONFIG_REFUSED_AT_CONSTRUCTION: "a configuration the connector cannot honour is a ConfigError naming the "
    "option when the connector is built, not later",
}


@dataclass(frozen=True)
class Violation:
    """One break of a rule, seen while the kit drove the connector."""

    rule: Rule
    detail: str

    def __str__(self) -> str:
        return f"[{self.rule.value}] {self.detail}"


def failure_message(rule: Rule, details: list[str]) -> str:
    """What a failed check says: the rule's id and statement, then what broke it (at most 10 lines)."""
    counts = dict.fromkeys(details, 0)
    for detail in details:
        counts[detail] += 1
    lines = [d if n == 1 else f"{d} ({n} times)" for d, n in counts.items()]
    shown = lines[:10] + ([f"... and {len(lines) - 10} more"] if len(lines) > 10 else [])
    return f"kvbridge connector rule [{rule.value}] broken: {rule.statement}\n" + "\n".join(f"  - {d}" for d in shown)
