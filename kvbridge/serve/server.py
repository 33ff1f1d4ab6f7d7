"""`kvbridge serve`: one engine behind the OpenAI-compatible HTTP API (serve/api.py).

    kvbridge serve --role prefill --port 8100 --side-channel-port 5600 --model tiny
    kvbridge serve --role decode  --port 8200 --model tiny       # a decode node opens no side channel
    kvbridge serve --no-connector --port 8000                     # a plain engine

`--role` picks the NixlConnector's role (prefill -> kv_producer, decode -> kv_consumer, both ->
kv_both); `--kv-connector NAME` runs another connector, `--no-connector` none. The HTTP port is
bound before the engine is built (a busy one ends the process at once) and `/health` answers 503
until the engine is ready. A user error (a bad flag or `--model`, a busy port) is one named line
and exit code 2; any other start-up failure exit code 1. SIGINT/SIGTERM stop admitting, then
shut the engine down (which flushes its connector) before exiting. `--admin-token-file PATH` (else KVBRIDGE_ADMIN_TOKEN) makes
the admin endpoints require that bearer token (serve/admin.py). `--kv-events-config JSON` (vLLM's)
publishes the prefix cache's KV events over ZMQ in vLLM's format (engine/kv_events.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys

from kvbridge import env
from kvbridge.block_hash import VLLM_HASH_ALGOS, VllmBlockHasher
from kvbridge.cli_errors import error_line
from kvbridge.config import (
    DEFAULT_KV_TOKENS,
    DTYPES,
    TP_AWARE_CONNECTORS,
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from kvbridge.errors import ConfigError, TensorParallelError
from kvbridge.serve.lease_quota import DEFAULT_MAX_LEASED_FRACTION, DEFAULT_MAX_PER_CLIENT, LeaseQuota
from kvbridge.transfer.interfaces import advertised_host

logger = logging.getLogger(__name__)

ROLE_TO_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
DEFAULT_CONNECTOR = "NixlConnector"
DEFAULT_CUDA_MEMORY_FRACTION = 0.8  # of the memory free once the weights are loaded; the rest for activations


def add_arguments(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("network")
    net.add_argument("--role", choices=sorted(ROLE_TO_KV_ROLE), default="both", help="P/D role of this node")
    net.add_argument("--host", default="127.0.0.1", help="HTTP bind address (loopback: the API has no authentication)")
    net.add_argument("--port", type=int, default=8000, help="HTTP port")
    net.add_argument(
        "--side-channel-port", type=int, default=0,
        help="port of the connector's side channel, where decode nodes reach a prefill node (0: pick one). Only a "
        "node that serves KV (--role prefill or both) listens: giving it to any other node is an error",
    )  # fmt: skip
    net.add_argument(
        "--side-channel-host", default=None,
        help="address peers reach this node's side channel and KV at (default: --host; for a wildcard --host, "
        "the default route's address)",
    )  # fmt: skip
    net.add_argument(
        "--admin-token-file", default=None, metavar="PATH",
        help="file holding the bearer token the admin endpoints require (default: $KVBRIDGE_ADMIN_TOKEN, else open)",
    )  # fmt: skip
    model = parser.add_argument_group("model")
    model.add_argument("--model", default="tiny", help="built-in preset or local checkpoint directory")
    model.add_argument("--served-model-name", default=None, help="name clients send as 'model' (default: --model)")
    model.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV cache precision")
    model.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    model.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    model.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    model.add_argument("--num-threads", type=int, default=None, help="torch CPU threads of this process (default: torch's)")
    model.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="ranks that split the attention heads and the MLP, one process each (on CUDA one GPU each, from "
        "--device on); must divide the attention heads; with a connector, the NixlConnector only",
    )  # fmt: skip
    model.add_argument(
        "--enforce-eager", action="store_true",
        help="on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs (slower; for debugging)",
    )  # fmt: skip
    cache = parser.add_argument_group("cache and scheduler")
    cache.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    cache.add_argument(
        "--num-blocks", type=int, default=None,
        help=f"KV cache size in blocks (default: on CUDA, --memory-fraction {DEFAULT_CUDA_MEMORY_FRACTION} of the "
        f"memory free after the weights load; on CPU, {DEFAULT_KV_TOKENS} tokens' worth, small because CPU nodes "
        "share the host's RAM)",
    )  # fmt: skip
    cache.add_argument(
        "--memory-fraction", type=float, default=None,
        help="size the KV cache as this fraction of free memory instead: CUDA memory free after the weights load, "
        "or the host's available RAM capped at 8 GiB (default: see --num-blocks)",
    )  # fmt: skip
    cache.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes")
    cache.add_argument("--max-num-seqs", type=int, default=64, help="requests in one step")
    cache.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    cache.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="schedule and launch the next decode step before waiting for this one's tokens (hides the host's "
        "step work behind the GPU's; without a KV connector (--no-connector), at --tensor-parallel-size 1; "
        "default: on where it can run on a CUDA device, off on the CPU)",
    )  # fmt: skip
    events = parser.add_argument_group("KV events (vLLM's format, for routers: docs/deploy.md)")
    events.add_argument(
        "--kv-events-config", default=None, metavar="JSON",
        help="vLLM's KV events config, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
        "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}': publish every block the prefix "
        "cache stores and evicts, and every reset, as vLLM does (default: none)",
    )  # fmt: skip
    events.add_argument(
        "--prefix-caching-hash-algo", choices=VLLM_HASH_ALGOS, default="sha256",
        help="vLLM's block-hash algorithm, for the hashes KV events carry (set it as the fleet's vLLM nodes and "
        "router have it; kvbridge's own prefix cache is not affected)",
    )  # fmt: skip
    kv = parser.add_argument_group("KV connector")
    kv.add_argument("--kv-connector", default=DEFAULT_CONNECTOR, help="connector name or module:Class")
    kv.add_argument("--no-connector", action="store_true", help="run a plain engine without a connector")
    kv.add_argument("--engine-id", default=None, help="this engine's id in transfers (default: random)")
    kv.add_argument(
        "--load-failure-policy", choices=("recompute", "fail"), default=None,
        help="when KV cannot be pulled: compute the prompt here, or fail the request (default: recompute)",
    )  # fmt: skip
    kv.add_argument(
        "--flush-timeout", type=float, default=None, metavar="SECONDS",
        help="how long shutdown and reset_prefix_cache wait for in-flight transfers (default: "
        "$KVBRIDGE_FLUSH_TIMEOUT_S, else 30)",
    )  # fmt: skip
    kv.add_argument(
        "--kv-connector-extra", default=None, metavar="JSON",
        help="JSON object of connector-specific options; an unknown key is refused (default: {})",
    )  # fmt: skip
    kv.add_argument(
        "--max-leases-per-client", type=int, default=DEFAULT_MAX_PER_CLIENT, metavar="N",
        help="do_remote_decode requests one client (HTTP peer address) may have holding KV blocks at once; "
        "more are refused with HTTP 429",
    )  # fmt: skip
    kv.add_argument(
        "--max-leased-fraction", type=float, default=DEFAULT_MAX_LEASED_FRACTION, metavar="F",
        help="share of the KV cache's blocks that leases may hold; a do_remote_decode request that would pass it "
        "(and so wait for leases to end) is refused with HTTP 429",
    )  # fmt: skip
    kv.add_argument(
        "--insecure-side-channel", action="store_true",
        help="run the side channel unauthenticated when KVBRIDGE_SIDE_CHANNEL_SECRET is unset, instead of with "
        "this user's host secret (and off loopback, where no secret is refused): anyone who reaches it can then "
        "read and write this node's KV cache",
    )  # fmt: skip


# Flags that configure the connector: with --no-connector nothing would honour them.
CONNECTOR_FLAGS = {
    "--kv-connector": lambda a: a.kv_connector != DEFAULT_CONNECTOR,
    "--side-channel-port": lambda a: a.side_channel_port != 0,
    "--side-channel-host": lambda a: a.side_channel_host is not None,
    "--engine-id": lambda a: a.engine_id is not None,
    "--load-failure-policy": lambda a: a.load_failure_policy is not None,
    "--flush-timeout": lambda a: a.flush_timeout is not None,
    "--kv-connector-extra": lambda a: a.kv_connector_extra is not None,
    "--insecure-side-channel": lambda a: a.insecure_side_channel,
}


def cache_sizing(args: argparse.Namespace) -> tuple[int | None, float | None]:
    """(num_blocks, memory_fraction) for CacheConfig. A node on CUDA with neither flag sizes its cache
    from free memory; on CPU the engine's small default applies (kvbridge/engine/kv_cache.py)."""
    if args.num_blocks is None and args.memory_fraction is None and args.device.startswith("cuda"):
        return None, DEFAULT_CUDA_MEMORY_FRACTION
    return args.num_blocks, args.memory_fraction


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe (pure, but for `--host 0.0.0.0` without
    `--side-channel-host`, which looks up the default route's address). Raises ConfigError naming
    the bad flag."""
    kv_transfer = None
    if args.tensor_parallel_size > 1 and not args.no_connector and args.kv_connector not in TP_AWARE_CONNECTORS:
        raise TensorParallelError(
            f"--tensor-parallel-size {args.tensor_parallel_size} with --kv-connector {args.kv_connector}: only "
            f"{', '.join(sorted(TP_AWARE_CONNECTORS))} runs with tensor parallelism; pass --no-connector, or --tensor-parallel-size 1"
        )
    if args.no_connector:
        given = [flag for flag, is_given in CONNECTOR_FLAGS.items() if is_given(args)]
        if given:
            raise ConfigError(f"{', '.join(given)} configure(s) the connector, but --no-connector runs none; drop one or the other")
    else:
        try:
            extra = json.loads(args.kv_connector_extra or "{}")
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--kv-connector-extra is not valid JSON: {exc}") from exc
        if not isinstance(extra, dict):
            raise ConfigError("--kv-connector-extra must be a JSON object, e.g. '{\"lease_s\": 30}'")
        optional = {"engine_id": args.engine_id} if args.engine_id else {}
        if args.insecure_side_channel:
            extra = {**extra, "insecure_side_channel": True}
        kv_transfer = KVTransferConfig(
            connector=args.kv_connector,
            role=ROLE_TO_KV_ROLE[args.role],
            side_channel_host=advertised_host(args.host, args.side_channel_host),
            side_channel_port=args.side_channel_port,
            load_failure_policy=args.load_failure_policy or "recompute",
            flush_timeout_s=args.flush_timeout if args.flush_timeout is not None else env.flush_timeout_s(),
            extra=extra,
            **optional,
        )
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a port")
    num_blocks, memory_fraction = cache_sizing(args)
    return EngineConfig(
        model=ModelConfig(
            model=args.model, dtype=args.dtype, device=args.device, seed=args.seed, max_model_len=args.max_model_len,
            enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=num_blocks,
            memory_fraction=memory_fraction,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            async_scheduling=args.async_scheduling,
        ),
        kv_transfer=kv_transfer,
        kv_events=kv_events_config(args),
    )


def kv_events_config(args: argparse.Namespace) -> KVEventsConfig | None:
    """`--kv-events-config` with `--prefix-caching-hash-algo`; the hasher is built now, so that a bad
    algorithm or seed is refused before any port is bound."""
    if args.kv_events_config is None:
        if args.prefix_caching_hash_algo != "sha256":
            raise ConfigError("--prefix-caching-hash-algo decides the hashes KV events carry: give --kv-events-config too")
        return None
    config = KVEventsConfig.from_json(args.kv_events_config)
    config = dataclasses.replace(config, prefix_caching_hash_algo=args.prefix_caching_hash_algo)
    VllmBlockHasher(config.prefix_caching_hash_algo, env.vllm_none_hash_seed())
    return config


def _engine_factory(config: EngineConfig, num_threads: int | None):
    def build():
        from kvbridge.engine.core import EngineCore  # torch: imported on the engine thread, in run()

        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
        return EngineCore(config)

    return build


async def serve(app, engine, sock, describe: str) -> int:
    """Serve `app` on `sock` until SIGINT/SIGTERM or an engine start-up failure; returns the exit code:
    0, 2 for a start-up failure that a flag caused (a ConfigError), else 1."""
    from kvbridge.serve.listen import serving, stop_signal

    stopped = stop_signal()
    async with serving(app, sock):
        ready = asyncio.ensure_future(engine.wait_ready(timeout_s=3600))
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.exception() is not None:
            cause = ready.exception().__cause__ or ready.exception()  # the engine's own error, not EngineDeadError
            print(error_line("serve", cause, "engine start-up failed"), file=sys.stderr, flush=True)
            return 2 if isinstance(cause, ConfigError) else 1
        if ready.done():
            print(f"kvbridge serve: ready: {describe}", file=sys.stderr, flush=True)
        logger.info("%s: stopping; in-flight requests end, then the engine shuts down", await stopped)
        ready.cancel()
    return 0


def run(args: argparse.Namespace) -> int:
    from kvbridge.engine.presets import check_model_source
    from kvbridge.serve.admin import open_admin_warning, read_admin_token
    from kvbridge.serve.api import create_app
    from kvbridge.serve.async_engine import AsyncEngine
    from kvbridge.serve.listen import bind

    try:
        check_model_source(args.model)  # before anything starts: a bad --model is a bad flag
        config = build_engine_config(args)
        if config.kv_transfer is not None:  # every option honoured, or refused now: before any port is bound
            from kvbridge.connectors.factory import check_connector_config

            check_connector_config(config.kv_transfer)
            if config.kv_transfer.connector in ("NixlConnector", "MultiConnector"):  # those that speak on a side channel
                from kvbridge.transfer.host_secret import side_channel_secret

                side_channel_secret(args.insecure_side_channel)  # a short or untrustworthy secret: before the model loads
        lease_quota = LeaseQuota(args.max_leases_per_client, args.max_leased_fraction)
        admin_token = read_admin_token(args.admin_token_file, env.admin_token())
        sock = bind(args.host, args.port)  # before the engine: a busy port fails at once
    except ConfigError as exc:
        print(error_line("serve", exc), file=sys.stderr)
        return 2
    if (warning := open_admin_warning(args.host, args.port, admin_token)) is not None:
        logger.warning("%s", warning)
    connector = f"{config.kv_transfer.connector}/{config.kv_transfer.role}" if config.kv_transfer else "no connector"
    url = f"http://{args.host}:{args.port}"
    logger.info("starting: model %s (%s on %s), role %s, %s; %s/health answers 503 until the engine is built",
                args.model, args.dtype, args.device, args.role, connector, url)  # fmt: skip
    engine = AsyncEngine(_engine_factory(config, args.num_threads))
    engine.start()
    app = create_app(engine, args.served_model_name or args.model, args.role, admin_token, lease_quota)
    try:
        return asyncio.run(serve(app, engine, sock, f"role={args.role}, {connector} on {url}"))
    finally:
        engine.shutdown()
        logger.info("stopped")
