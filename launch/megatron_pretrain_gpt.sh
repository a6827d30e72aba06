#!/bin/bash
# Megatron-LM pretrain_gpt.py under mechmon on one node (torchrun). Megatron-LM args follow:
#
#   MEGATRON_LM_PATH=~/Megatron-LM MECHMON_CONFIG=mechmon.yaml \
#     bash launch/megatron_pretrain_gpt.sh --num-layers 24 ... --data-path ...
#
# Added: --save/--load $CHECKPOINT_DIR and --exit-signal-handler. Exit code: 86 (mechmon alarm;
# the alarm file is printed), else torchrun's. torchrun turns a worker's 86 into 1, so an alarm is
# also recognised by an alarm.json in $CHECKPOINT_DIR written during this run whose action is
# checkpoint_and_exit (mechmon_is_alarm in slurm/common.sh).
# Several nodes: slurm/megatron_lm.sbatch.
#
# Environment overrides (defaults in brackets):
#   MEGATRON_LM_PATH   Megatron-LM checkout [$HOME/Megatron-LM]
#   MECHMON_CONFIG     mechmon YAML [./mechmon.yaml]
#   CHECKPOINT_DIR     --save/--load [./checkpoints]
#   GPUS_PER_NODE      [8]
#   TORCHRUN           [torchrun]
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=slurm/common.sh
source "$REPO/slurm/common.sh"

MEGATRON_LM_PATH="${MEGATRON_LM_PATH:-$HOME/Megatron-LM}"
MECHMON_CONFIG="${MECHMON_CONFIG:-$PWD/mechmon.yaml}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-$PWD/checkpoints}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
TORCHRUN="${TORCHRUN:-torchrun}"

mkdir -p "$CHECKPOINT_DIR"
STAMP="$(mktemp "$CHECKPOINT_DIR/.mechmon_attempt.XXXXXX")"
trap 'rm -f "$STAMP"' EXIT

rc=0
"$TORCHRUN" --standalone --nproc-per-node="$GPUS_PER_NODE" \
  -m mechmon_megatron.launch.megatron "$MEGATRON_LM_PATH/pretrain_gpt.py" \
  --mechmon-config "$MECHMON_CONFIG" "$@" \
  --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --exit-signal-handler || rc=$?

alarm="$(mechmon_fresh_alarm "$CHECKPOINT_DIR" "$STAMP")"
if mechmon_is_alarm "$rc" "$alarm"; then
  if [[ -n "$alarm" ]]; then
    mechmon_alarm_report "$alarm"
  fi
  exit "$MECHMON_EXIT_CODE"
fi
exit "$rc"
