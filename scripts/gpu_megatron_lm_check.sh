#!/bin/bash
# End-to-end check of the Megatron-LM integration on one GPU (not runnable on CPU).
#
#   MEGATRON_LM_PATH=/path/to/Megatron-LM bash scripts/gpu_megatron_lm_check.sh
#
# 1. pretrain_gpt.py --mock-data, a tiny GPT, up to TRAIN_ITERS iterations, under
#    python -m mechmon_megatron.launch.megatron (no torchrun: it would report exit code 1).
#    Injected fault: the mechmon config bounds global/loss above by 0 from step ARM_STEP on, so
#    the first monitored step >= ARM_STEP raises the alarm (action checkpoint_and_exit).
#    Expected: exit code 86, $WORK_DIR/ckpt/alarm.json, the alarm checkpoint
#    iter_NNNNNNN (with mechmon_rank0.pt) as Megatron's latest checkpoint.
# 2. The same command again (resume from the alarm checkpoint): exit code 86 before any step, the
#    latest checkpoint unchanged.
#
# MODE=fp8 instead runs the Transformer Engine spec in FP8 (--fp8-format hybrid, delayed scaling,
# FP8 dot-product attention, --log-max-attention-logit; TE >= 2.9) for TRAIN_ITERS iterations
# with on_alarm: log, and checks that the fp8 family's signals appear in metrics.jsonl: per TE
# module amax / scale / headroom, the attention family's per-head max logits, and (MoE with TE
# grouped GEMM, FP8_MOE_ARGS) the router signals. Expected: exit code 0, "ok: fp8 signals ...", PASS.
#
# Environment overrides (defaults in brackets):
#   MEGATRON_LM_PATH  Megatron-LM checkout (required)
#   WORK_DIR          output directory [a new temporary directory]
#   PYTHON            [python]
#   TRAIN_ITERS       [100]
#   ARM_STEP          first step the loss bound applies to [50]
#   MASTER_PORT       [29561]
#   EXTRA_ARGS        extra Megatron-LM arguments, e.g. "--transformer-impl local" [none]
#   MODE              alarm | fp8 [alarm]
#   FP8_MOE_ARGS      MoE arguments of MODE=fp8 [--num-experts 4 --moe-router-topk 2
#                     --moe-grouped-gemm --moe-token-dispatcher-type alltoall
#                     --moe-router-padding-for-quantization]; set to " " for a dense model
set -euo pipefail

: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout}"
WORK_DIR="${WORK_DIR:-$(mktemp -d -t mechmon_gpu_check.XXXXXX)}"
PYTHON="${PYTHON:-python}"
TRAIN_ITERS="${TRAIN_ITERS:-100}"
ARM_STEP="${ARM_STEP:-50}"
read -r -a EXTRA <<<"${EXTRA_ARGS:-}"
MODE="${MODE:-alarm}"
read -r -a FP8_MOE <<<"${FP8_MOE_ARGS:---num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-router-padding-for-quantization}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CKPT="$WORK_DIR/ckpt"
CONFIG="$WORK_DIR/mechmon.yaml"

export MASTER_ADDR=127.0.0.1 MASTER_PORT="${MASTER_PORT:-29561}"
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONPATH="$REPO:$MEGATRON_LM_PATH${PYTHONPATH:+:$PYTHONPATH}"

mkdir -p "$WORK_DIR"
cat >"$CONFIG" <<YAML
output_dir: $WORK_DIR/mechmon_out
qk:
  interval: 10
router:
  interval: 10
detectors:
  start_step: $ARM_STEP
  global:
    bounds:
      max: 0.0
actions:
  on_alarm: checkpoint_and_exit
YAML

run_megatron() {
  "$PYTHON" -m mechmon_megatron.launch.megatron "$MEGATRON_LM_PATH/pretrain_gpt.py" \
    --mechmon-config "$CONFIG" \
    --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --max-position-embeddings 128 --micro-batch-size 4 --global-batch-size 4 \
    --train-iters "$TRAIN_ITERS" --lr 1e-4 --lr-decay-style constant --bf16 \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 \
    --save "$CKPT" --load "$CKPT" --save-interval 20 --log-interval 10 \
    --eval-interval 100000 --eval-iters 0 --tensorboard-dir "$WORK_DIR/tb" \
    "${EXTRA[@]}"
}

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

if [[ "$MODE" == fp8 ]]; then
  cat >"$CONFIG" <<YAML
output_dir: $WORK_DIR/mechmon_out
qk:
  interval: 10
router:
  interval: 10
fp8:
  enabled: true
  interval: 10
actions:
  on_alarm: log
YAML
  EXTRA+=(--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe delayed
    --fp8-amax-history-len 16 --fp8-amax-compute-algo max --fp8-dot-product-attention
    --log-max-attention-logit "${FP8_MOE[@]}")
  echo "== fp8: TE spec in FP8 for $TRAIN_ITERS iterations (work dir $WORK_DIR)"
  rc=0
  run_megatron >"$WORK_DIR/fp8.log" 2>&1 || rc=$?
  [[ "$rc" == 0 ]] || fail "fp8 run exit code $rc, expected 0 (log: $WORK_DIR/fp8.log)"
  METRICS="$WORK_DIR/mechmon_out/metrics.jsonl"
  [[ -f "$METRICS" ]] || fail "no $METRICS"
  MOE=0
  [[ " ${FP8_MOE[*]} " == *" --num-experts "* ]] && MOE=1
  "$PYTHON" - "$METRICS" "$MOE" <<'PY' || fail "fp8 signals missing (metrics: $METRICS)"
import json, math, sys

rows = [json.loads(line) for line in open(sys.argv[1])]
last = [r for r in rows if r.get("signals")][-1]
finite = {k: v for k, v in last["signals"].items() if v is not None and math.isfinite(v)}
need = {
    "amax": "fp8/amax_log2/self_attention.linear_qkv.fwd/layer_1",
    "headroom": "fp8/headroom_log2/self_attention.linear_qkv.bwd/layer_1",
    "attention amax": "fp8/amax_log2/self_attention.core_attention.fwd/layer_1",
    "max logit": "attn/max_logit/max/layer_1/head_0",
    "layer max logit": "attn/max_logit/max/layer_1",
    "qk": "attn/delta2/entropy/layer_1/min",
}
if sys.argv[2] == "1":
    need["router"] = "router/entropy_mean/layer_1"
    need["grouped experts"] = "fp8/amax_log2/mlp.experts.linear_fc1.fwd/layer_1"
missing = {k: v for k, v in need.items() if v not in finite}
fp8 = sorted(k for k in finite if k.startswith("fp8/"))
print(f"step {last['step']}: {len(fp8)} finite fp8 signals, e.g. {fp8[:3]}")
print("coverage:", json.dumps(last.get("coverage", {}).get("fp8", {})))
if missing:
    print("missing:", missing)
    sys.exit(1)
PY
  echo "ok: fp8 signals (amax, scale, headroom) and per-head max logits in $METRICS"
  echo "PASS"
  exit 0
fi

echo "== run 1: train until the alarm (work dir $WORK_DIR)"
rc=0
run_megatron >"$WORK_DIR/run1.log" 2>&1 || rc=$?
[[ "$rc" == 86 ]] || fail "run 1 exit code $rc, expected 86 (log: $WORK_DIR/run1.log)"
ALARM="$CKPT/alarm.json"
[[ -f "$ALARM" ]] || fail "no $ALARM"
STEP="$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["alarm_step"])' "$ALARM")"
ITER_DIR="$CKPT/$(printf 'iter_%07d' "$STEP")"
[[ -d "$ITER_DIR" ]] || fail "no alarm checkpoint $ITER_DIR"
[[ -f "$ITER_DIR/mechmon_rank0.pt" ]] || fail "no monitor state in $ITER_DIR"
LATEST="$(cat "$CKPT/latest_checkpointed_iteration.txt")"
[[ "$LATEST" == "$STEP" ]] || fail "latest checkpoint $LATEST, alarm step $STEP"
((STEP >= ARM_STEP)) || fail "alarm at step $STEP before ARM_STEP=$ARM_STEP"
echo "ok: exit 86, alarm step $STEP, checkpoint $ITER_DIR, alarm file $ALARM"

echo "== run 2: resume from the alarm checkpoint"
rc=0
run_megatron >"$WORK_DIR/run2.log" 2>&1 || rc=$?
[[ "$rc" == 86 ]] || fail "run 2 exit code $rc, expected 86 (log: $WORK_DIR/run2.log)"
grep -q "on resume, before any step" "$WORK_DIR/run2.log" || fail "run 2 did not re-raise on resume"
[[ "$(cat "$CKPT/latest_checkpointed_iteration.txt")" == "$STEP" ]] || fail "run 2 saved again"
echo "ok: resume re-raised the alarm before any step"
echo "PASS"
