"""How a `kvbridge` command reports a failure: one line on stderr, naming flags as the user typed them.

Below the CLI, so the command modules (`cli_generate`, `serve.server`, `serve.proxy`, `serve.demo`)
report errors the same way without importing `kvbridge.cli`, which imports them.
"""

from __future__ import annotations

import re

# Config fields that a flag sets, as errors name them, and the flag a CLI user types instead.
CONFIG_FLAGS = {
    "ModelConfig.model": "--model",
    "ModelConfig.dtype": "--dtype",
    "ModelConfig.device": "--device",
    "ModelConfig.seed": "--seed",
    "ModelConfig.max_model_len": "--max-model-len",
    "ModelConfig.tensor_parallel_size": "--tensor-parallel-size",
    "CacheConfig.block_size": "--block-size",
    "CacheConfig.num_blocks": "--num-blocks",
    "CacheConfig.memory_fraction": "--memory-fraction",
    "SchedulerConfig.max_num_seqs": "--max-num-seqs",
    "SchedulerConfig.max_num_batched_tokens": "--max-num-batched-tokens",
    "SchedulerConfig.async_scheduling": "--async-scheduling",
    "KVTransferConfig.connector": "--kv-connector",
    "KVTransferConfig.engine_id": "--engine-id",
    "KVTransferConfig.load_failure_policy": "--load-failure-policy",
    "KVTransferConfig.side_channel_host": "--side-channel-host",
    "KVTransferConfig.side_channel_port": "--side-channel-port",
    "KVTransferConfig.flush_timeout_s": "--flush-timeout",
    "KVTransferConfig.extra": "--kv-connector-extra",
}
# A field, and the value after `=` when there is one ('quoted' or bare).
_CONFIG_FIELD = re.compile(r"\b((?:Model|Cache|Scheduler|KVTransfer)Config\.\w+)(=(?:'([^'\s]*)'|(?=\S)))?")


def flag_names(message: str) -> str:
    """`message` with the config fields that a flag sets named by the flag, the way it is typed
    (`CacheConfig.num_blocks=1` -> `--num-blocks 1`, `KVTransferConfig.load_failure_policy='fail'`
    -> `--load-failure-policy fail`): the library's errors name fields, a CLI user needs the flag."""

    def to_flag(match: re.Match) -> str:
        flag = CONFIG_FLAGS.get(match.group(1))
        if flag is None:
            return match.group(0)
        if match.group(2) is None:
            return flag
        return f"{flag} {match.group(3)}" if match.group(3) is not None else f"{flag} "

    return _CONFIG_FIELD.sub(to_flag, message)


class FlagNamesFilter:
    """A logging filter that names config fields by their flags in every record (`flag_names`): the
    library logs fields, a command's user reads flags. Installed on the handlers of `kvbridge` commands."""

    def filter(self, record) -> bool:
        message = record.getMessage()
        named = flag_names(message)
        if named != message:
            record.msg, record.args = named, None
        return True


def error_line(command: str, exc: BaseException, context: str | None = None) -> str:
    """One line for stderr: `kvbridge COMMAND: [CONTEXT: ]ErrorName: message`, flags named as typed."""
    prefix = f"kvbridge {command}: " + (f"{context}: " if context else "")
    return prefix + f"{type(exc).__name__}: {flag_names(str(exc))}"
