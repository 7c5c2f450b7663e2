#!/usr/bin/env bash
# The GPU checks in one call on a lent CUDA machine (see bench/RESULTS.md, "GPU checks"):
# numerics of the FSDP engine (fp32 and bf16, prompts shared or not) against an unsharded
# transformers model, NCCL, weight sync; the training engine and the rollout engine against the plain
# transformers loops at qwen2-0.5b (Qwen2-0.5B's shapes, built from its config); then the GRPO step
# against TRL's (bench/vs_trl.py --device cuda: Tandem through `tandem serve` and a submitted job,
# 64 and 256 new tokens with every row trained, 64 with the exact-answer reward). Each step has its
# own time limit, so one hang costs only its share. The rollout steps set the default decode (a CUDA
# graph) beside the step-by-step loop: speed in bf16, greedy tokens equal in fp32. JSON lines go to $OUT (or ./gpu-out).
#
#   bash bench/gpu_suite.sh            # the machine's python3 (torch with CUDA)
#   CHECKS=0 bash bench/gpu_suite.sh   # the comparison with TRL alone
#   ONLY="gpu_check_05b vs_trl_digits" bash bench/gpu_suite.sh   # these steps alone
#
# What the machine lacks comes from the offline bundle (`make bundle PYTHON=3.12`, dist/offline/,
# installed by its install.sh into /tmp/site) and from wheels in .whl/ (TRL and its needs for the
# comparison): see docs/guides/offline.md and /work/.library/device/README.md on carrying them.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTHONPATH=$PWD
if [ -x dist/offline/install.sh ]; then
    PYTHON=python3 dist/offline/install.sh --target /tmp/site || exit 1
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
step() {  # step NAME SECONDS COMMAND...: run with a limit, output to $OUT/NAME.log, JSON lines to NAME.jsonl
    local name=$1 limit=$2
    shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    echo "== $name ($(date +%T), load $(cut -d' ' -f1 /proc/loadavg))"
    timeout "$limit" "$@" 2> >(tail -n 40 >"$OUT/$name.err") | tee "$OUT/$name.jsonl"
    echo "== $name exit ${PIPESTATUS[0]}"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)"
git log -1 --format='commit %h %s' 2>/dev/null || true
python3 -c "from engines.models.tiny_models import build_builtin_model as b; print(b('qwen2-0.5b', '/tmp/models'))"
M=/tmp/models/qwen2-0.5b
if [ "${CHECKS:-1}" != 0 ]; then
step train_engine_05b 200 python3 bench/train_engine.py --device cuda --model "$M" ${TRAIN_ARGS:-}
step rollout_05b 100 python3 bench/rollout.py --device cuda --models "$M" --batch 128 --group 8 \
    --new-tokens 64 --threads 8 --no-vllm --loop --repeats 2
step rollout_05b_fp32 60 python3 bench/rollout.py --device cuda --models "$M" --batch 32 --group 4 \
    --new-tokens 64 --threads 8 --no-vllm --loop --repeats 1 --dtype float32
step gpu_check_05b 120 python3 bench/gpu_check.py --model "$M"
step gpu_check_20m 90 python3 bench/gpu_check.py --model qwen2-20m
fi
VS="python3 bench/vs_trl.py --device cuda --model qwen2-0.5b --rounds 1 --steps 4"
step vs_trl_digits 300 $VS --new-tokens 64,256 --reward digits
step vs_trl_exact 150 $VS --new-tokens 64 --reward arithmetic
echo "== done $(date +%T)"
