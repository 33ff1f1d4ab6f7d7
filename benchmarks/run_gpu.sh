#!/usr/bin/env bash
# Every GPU test and GPU benchmark in one go, for a CUDA machine with 2 GPUs (1 works; the P/D
# figures then stay on one GPU). Logs and one JSON per benchmark land in ${OUT:-gpu-results}/.
# With NIXL and friends as wheels in .whl/ (see docs/benchmarks.md), install them first:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
set -u
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
decode_dev=cuda:$((ngpu > 1 ? 1 : 0))
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpus.csv" 2>&1

bench() {  # name, then the command; keeps going when one fails. One JSON line per benchmark:
  # {"name", "command", "result"}; `python benchmarks/results.py keep-all results.jsonl` keeps them.
  local name=$1; shift
  echo "== $name: $*" | tee -a "$out/bench.log"
  timeout 900 "$@" --json > "$out/$name.json" 2>> "$out/bench.log"; echo "$name rc=$?" | tee -a "$out/bench.log"
  python3 -c 'import json,sys; print(json.dumps({"name": sys.argv[2], "command": " ".join(sys.argv[3:]),
    "result": json.load(open(sys.argv[1]))}))' "$out/$name.json" "$name" "$@" --json >> "$out/results.jsonl" \
    && rm "$out/$name.json"
}

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 1500 python3 -m pytest -q -p no:cacheprovider -m gpu -o addopts="--strict-markers -ra" -s \
    tests/engine/test_model_runner_gpu.py tests/engine/test_fused_ops.py tests/engine/test_paged_decode.py \
    tests/engine/test_cuda_graphs.py tests/test_memory_snapshot.py tests/test_shutdown_memory.py \
    tests/connectors/offload tests/connectors/nixl_connector tests/transfer/test_endpoint.py \
    tests/transfer/test_digest.py > "$out/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "passed|failed|error" "$out/gpu_tests.log" | tail -3
fi

bench transfer_bw-h200 python3 benchmarks/transfer_bw.py --device cuda
bench transfer_bw_nixl-h200 python3 benchmarks/transfer_bw.py --device cuda --no-cuda-ipc
if [ "$ngpu" -gt 1 ]; then bench ipc_copy_methods python3 benchmarks/ipc_copy_methods.py; fi
bench pd_transfer-h200 python3 benchmarks/pd_transfer.py --model llama3-8b --dtype bfloat16 --prompt-len 4096 \
  --prefill-device cuda:0 --decode-device "$decode_dev"
bench pd_transfer_no_digest-h200 python3 benchmarks/pd_transfer.py --model llama3-8b --dtype bfloat16 --prompt-len 4096 \
  --prefill-device cuda:0 --decode-device "$decode_dev" --no-verify-kv-digest
bench offload_bw-h200 python3 benchmarks/offload_bw.py --device cuda
bench offload_ttft-h200 python3 benchmarks/offload_ttft.py --device cuda --model llama3-8b --prompt-len 4096
bench decode_step-h200 python3 benchmarks/decode_step.py --device cuda --preset llama3-8b --dtype bfloat16 \
  --context-len 4096 --batch 1 --batch 32
bench engine_throughput-h200 python3 benchmarks/engine_throughput.py --device cuda --preset llama3-8b --dtype bfloat16 \
  --batch 1 --prompt-len 4096 --decode-len 32
