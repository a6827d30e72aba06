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
# Environment overrides (defaults in brackets):
#   MEGATRON_LM_PATH  Megatron-LM checkout (required)
#   WORK_DIR          output directory [a new temporary directory]
#   PYTHON            [python]
#   TRAIN_ITERS       [100]
#   ARM_STEP          first step the loss bound applies to [50]
#   MASTER_PORT       [29561]
#   EXTRA_ARGS        extra Megatron-LM arguments, e.g. "--transformer-impl local" [none]
set -euo pipefail

: "${MEGATRON_LM_PATH:?set MEGATRON_LM_PATH to a Megatron-LM checkout}"
WORK_DIR="${WORK_DIR:-$(mktemp -d -t mechmon_gpu_check.XXXXXX)}"
PYTHON="${PYTHON:-python}"
TRAIN_ITERS="${TRAIN_ITERS:-100}"
ARM_STEP="${ARM_STEP:-50}"
read -r -a EXTRA <<<"${EXTRA_ARGS:-}"
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
