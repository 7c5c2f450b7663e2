#!/usr/bin/env bash
# The GPU checks in one call on a lent CUDA machine (see bench/RESULTS.md, "GPU checks"):
# numerics of the FSDP engine (fp32 and bf16, prompts shared or not) against an unsharded
# transformers model, NCCL, weight sync; the training engine and the rollout engine against the plain
# transformers loops at qwen2-0.5b (Qwen2-0.5B's shapes, built from its config). Each step has its
# own time limit, so one hang costs only its share. JSON lines go to $OUT (or ./gpu-out).
#
#   bash bench/gpu_suite.sh            # the machine's python3 (torch with CUDA)
#
# Wheels the machine lacks (pydantic, tensordict, the project's transformers) are installed from
# .whl/ when that folder exists: see /work/.library/device/README.md on carrying them.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
step() {  # step NAME SECONDS COMMAND...: run with a limit, output to $OUT/NAME.log, JSON lines to NAME.jsonl
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T), load $(cut -d' ' -f1 /proc/loadavg))"
    timeout "$limit" "$@" 2> >(tail -n 40 >"$OUT/$name.err") | tee "$OUT/$name.jsonl"
    echo "== $name exit ${PIPESTATUS[0]}"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)"
git log -1 --format='commit %h %s' 2>/dev/null || true
python3 -c "from engines.tiny_models import build_builtin_model as b; print(b('qwen2-0.5b', '/tmp/models'))"
M=/tmp/models/qwen2-0.5b
step train_engine_05b 200 python3 bench/train_engine.py --device cuda --model "$M" ${TRAIN_ARGS:-}
step rollout_05b 120 python3 bench/rollout.py --device cuda --models "$M" --batch 64 --group 8 \
    --new-tokens 128 --threads 8 --no-vllm
step gpu_check_05b 120 python3 bench/gpu_check.py --model "$M"
step gpu_check_20m 90 python3 bench/gpu_check.py --model qwen2-20m
echo "== done $(date +%T)"
