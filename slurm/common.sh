# shellcheck shell=bash
# Shared helpers of the mechmon SLURM templates (sourced by megatron_lm.sbatch, deepspeed.sbatch).
#
# One job attempt:
#   hosts      <- scontrol show hostnames "$SLURM_JOB_NODELIST"   (first host = rendezvous host)
#   srun       -> one torchrun per node, c10d rendezvous at $MASTER_ADDR:$MASTER_PORT
#   USR1/TERM  -> preemption / time limit: SIGTERM forwarded to srun, the run saves and exits
#   exit       -> mechmon_decide: alarm | no_restart | preempted | rerun | node_failure | done |
#                 failed
#   requeue    <- preempted, Megatron's rerun code 16, node failure (bounded by MECHMON_MAX_REQUEUES)
#   never      <- alarm (exit code MECHMON_EXIT_CODE, default 86): the alarm report is printed;
#                 NVRx no-restart (exit MECHMON_NVRX_NO_RESTART_EXIT_CODE, default 93)
#
# torchrun reports any failed worker as exit code 1 (its summary lists each rank's exitcode 86 on
# stderr; its error_file stays empty: a worker that leaves by sys.exit records nothing), so the
# alarm is also recognised by an alarm.json under MECHMON_ALARM_DIR that is newer than the start
# of this attempt and whose action is checkpoint_and_exit. A fresh alarm.json of a logged alarm
# (action log / warn: training went on) is a report: a later crash stays a crash.
#
# NVRx ft_launcher (TORCHRUN=ft_launcher): it restarts workers after any non-zero exit, so under
# it mechmon's workers leave an alarm with exit 0 and ft_launcher ends the job; a clean exit with
# a fresh alarm.json whose action is checkpoint_and_exit is the alarm. ft_launcher's own
# no-restart code (--ft-no-restart-exit-code, MECHMON_NVRX_NO_RESTART_EXIT_CODE, default 93:
# NVRx decided the job must not restart) is never requeued either.
#
# MECHMON_DRY_RUN=1: no SLURM needed; a 2-node x 8-GPU allocation is simulated and every command
# (srun, scontrol) is printed instead of run.

MECHMON_EXIT_CODE="${MECHMON_EXIT_CODE:-86}"
MECHMON_MAX_REQUEUES="${MECHMON_MAX_REQUEUES:-5}"
MECHMON_RERUN_EXIT_CODE="${MECHMON_RERUN_EXIT_CODE:-16}"
MECHMON_NVRX_NO_RESTART_EXIT_CODE="${MECHMON_NVRX_NO_RESTART_EXIT_CODE:-93}"
MECHMON_DRY_RUN="${MECHMON_DRY_RUN:-0}"
MECHMON_PREEMPTED=0
MECHMON_SRUN_PID=""
MECHMON_STAMP=""

mechmon_log() {
  echo "[mechmon-slurm $(date -u +%Y-%m-%dT%H:%M:%SZ)] $*" >&2
}

# Simulated allocation for --dry-run: 2 nodes x 8 GPUs unless the caller set SLURM_* already.
mechmon_simulate_slurm() {
  export SLURM_JOB_ID="${SLURM_JOB_ID:-4242}"
  export SLURM_JOB_NAME="${SLURM_JOB_NAME:-mechmon-dry-run}"
  export SLURM_JOB_NODELIST="${SLURM_JOB_NODELIST:-gpu-node[001-002]}"
  export SLURM_NNODES="${SLURM_NNODES:-2}"
  export SLURM_GPUS_ON_NODE="${SLURM_GPUS_ON_NODE:-8}"
  export SLURM_RESTART_COUNT="${SLURM_RESTART_COUNT:-0}"
  export MECHMON_DRY_RUN_HOSTS="${MECHMON_DRY_RUN_HOSTS:-gpu-node001 gpu-node002}"
}

# Hostnames of the allocation, one per line, in SLURM order.
mechmon_hosts() {
  if [[ "$MECHMON_DRY_RUN" == 1 ]]; then
    tr ' ' '\n' <<<"$MECHMON_DRY_RUN_HOSTS"
  else
    scontrol show hostnames "$SLURM_JOB_NODELIST"
  fi
}

# "$@" as one shell-quoted line.
mechmon_quote() {
  local line
  printf -v line '%q ' "$@"
  echo "${line% }"
}

# Run "$@", or print it (shell-quoted) in dry-run mode.
mechmon_run() {
  if [[ "$MECHMON_DRY_RUN" == 1 ]]; then
    echo "+ $(mechmon_quote "$@")"
  else
    "$@"
  fi
}

# Print the command srun starts on each node of the allocation (the same on every node: the
# c10d rendezvous assigns node ranks).
mechmon_print_node_commands() {
  local i=0 host
  while read -r host; do
    echo "[node $i/$SLURM_NNODES $host] MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT" \
      "$(mechmon_quote "$@")"
    i=$((i + 1))
  done < <(mechmon_hosts)
}

mechmon_on_signal() {
  mechmon_log "received SIG$1: preemption or time limit; asking the run to save and stop"
  MECHMON_PREEMPTED=1
  if [[ -n "$MECHMON_SRUN_PID" ]]; then
    kill -TERM "$MECHMON_SRUN_PID" 2>/dev/null || true
  fi
}

# Start "$@" (srun ...) in the background, forward USR1/TERM as SIGTERM, wait for it to end.
# Returns its exit status.
mechmon_srun_and_wait() {
  trap 'mechmon_on_signal USR1' USR1
  trap 'mechmon_on_signal TERM' TERM
  "$@" &
  MECHMON_SRUN_PID=$!
  local rc
  while :; do
    rc=0
    wait "$MECHMON_SRUN_PID" || rc=$?
    # A trapped signal interrupts wait with a status > 128 while srun is still running.
    if ! kill -0 "$MECHMON_SRUN_PID" 2>/dev/null; then
      break
    fi
  done
  trap - USR1 TERM
  MECHMON_SRUN_PID=""
  return "$rc"
}

# Newest alarm.json under $1 modified after file $2 (empty if none).
mechmon_fresh_alarm() {
  local dir=$1 stamp=$2
  [[ -d "$dir" ]] || return 0
  find "$dir" -maxdepth 3 -name alarm.json -newer "$stamp" -printf '%T@ %p\n' 2>/dev/null \
    | sort -rn | sed -n 1p | cut -d' ' -f2-
}

# Print the alarm file's path and its main fields.
mechmon_alarm_report() {
  local file=$1
  echo "mechmon alarm report: $file"
  python3 - "$file" <<'EOF' || cat "$file"
import json, sys
with open(sys.argv[1], encoding="utf-8") as fh:
    alarm = json.load(fh)
keys = ("alarm_id", "fault_class", "families", "onset_step", "alarm_step", "exit_code",
        "alarm_checkpoint", "checkpoint_before_onset")
for key in keys:
    if key in alarm:
        print(f"  {key}: {alarm[key]}")
for item in alarm.get("evidence", [])[:3]:
    print(f"  evidence: {item}")
if "alarm_id" in alarm:
    print(f"  to resume anyway, set actions.acknowledge: {alarm['alarm_id']} in the mechmon config")
EOF
}

# Nodes of the allocation that SLURM reports as down, drained, failing or not responding.
mechmon_bad_nodes() {
  local host state
  while read -r host; do
    state=$(scontrol show node "$host" 2>/dev/null | sed -n 's/.*State=\([^ ]*\).*/\1/p')
    if [[ "$state" =~ DOWN|DRAIN|FAIL|NOT_RESPONDING ]]; then
      echo "$host"
    fi
  done < <(mechmon_hosts)
}

# True if the alarm file $1 asked the job to stop (action checkpoint_and_exit), as opposed to
# an alarm that was only logged (log / warn) while training went on.
mechmon_alarm_stops() {
  python3 - "$1" <<'EOF'
import json, sys
with open(sys.argv[1], encoding="utf-8") as fh:
    sys.exit(0 if json.load(fh).get("action") == "checkpoint_and_exit" else 1)
EOF
}

# True if an attempt that ended with status $1 was stopped by a mechmon alarm: the workers' own
# code (MECHMON_EXIT_CODE: the launcher without torchrun, srun with one task per GPU), or a fresh
# alarm file $2 (may be empty) whose action is checkpoint_and_exit, whatever the status (torchrun
# exits 1 for workers that exit 86; under ft_launcher the workers exit 0).
mechmon_is_alarm() {
  local rc=$1 alarm_file=$2
  [[ "$rc" == "$MECHMON_EXIT_CODE" ]] \
    || { [[ -n "$alarm_file" ]] && mechmon_alarm_stops "$alarm_file"; }
}

# Classify one attempt. Args: exit status, preempted (0/1), fresh alarm file (may be empty),
# comma-separated bad nodes (may be empty).
# Prints one of: alarm | no_restart | preempted | rerun | node_failure | done | failed.
mechmon_decide() {
  local rc=$1 preempted=$2 alarm_file=$3 bad_nodes=$4
  if mechmon_is_alarm "$rc" "$alarm_file"; then
    echo alarm
  elif [[ "$rc" == "$MECHMON_NVRX_NO_RESTART_EXIT_CODE" ]]; then
    echo no_restart
  elif [[ "$preempted" == 1 ]]; then
    echo preempted
  elif [[ "$rc" == "$MECHMON_RERUN_EXIT_CODE" ]]; then
    echo rerun
  elif [[ "$rc" != 0 ]] && [[ -n "$bad_nodes" ]]; then
    echo node_failure
  elif [[ "$rc" == 0 ]]; then
    echo "done"
  else
    echo failed
  fi
}

# Requeue this job unless MECHMON_MAX_REQUEUES restarts were used already. Returns 1 if not.
mechmon_requeue() {
  local why=$1 count="${SLURM_RESTART_COUNT:-0}"
  if ((count >= MECHMON_MAX_REQUEUES)); then
    mechmon_log "not requeueing ($why): restart $count reached MECHMON_MAX_REQUEUES=$MECHMON_MAX_REQUEUES"
    return 1
  fi
  mechmon_log "requeueing job $SLURM_JOB_ID ($why), restart $((count + 1))"
  mechmon_run scontrol requeue "$SLURM_JOB_ID"
}

# Act on the outcome of an attempt and return the job's exit status.
# Args: exit status of srun, directory searched for a fresh alarm file, start-of-attempt stamp.
mechmon_finish() {
  local rc=$1 alarm_dir=$2 stamp=$3 alarm_file="" bad="" outcome
  alarm_file=$(mechmon_fresh_alarm "$alarm_dir" "$stamp")
  if [[ "$rc" != 0 ]] && [[ "$MECHMON_DRY_RUN" != 1 ]]; then
    bad=$(mechmon_bad_nodes | paste -sd, -)
  fi
  outcome=$(mechmon_decide "$rc" "$MECHMON_PREEMPTED" "$alarm_file" "$bad")
  mechmon_log "attempt ended: exit status $rc, outcome $outcome"
  case "$outcome" in
    alarm)
      mechmon_log "mechmon alarm: NOT requeueing (a resumed run would raise the same alarm)"
      if [[ -n "$alarm_file" ]]; then
        mechmon_alarm_report "$alarm_file"
      else
        echo "mechmon alarm: no fresh alarm.json found under $alarm_dir"
      fi
      return "$MECHMON_EXIT_CODE"
      ;;
    no_restart)
      mechmon_log "NVRx decided the job must not restart (exit $rc): NOT requeueing"
      return "$rc"
      ;;
    preempted | rerun)
      mechmon_requeue "$outcome" || return "$rc"
      return 0
      ;;
    node_failure)
      mechmon_log "unhealthy nodes: $bad"
      if mechmon_requeue "node failure"; then
        mechmon_run scontrol update "JobId=$SLURM_JOB_ID" "ExcNodeList=$bad" || true
        return 0
      fi
      return "$rc"
      ;;
    *)
      return "$rc"
      ;;
  esac
}

# Run one attempt of a job: srun starts "$@" on every node; then classify, requeue or report.
# Args: directory where mechmon writes its alarm file, then the per-node command.
# Uses SLURM_NNODES, SRUN_EXTRA (array, may be empty). Exits the calling script.
mechmon_launch() {
  local alarm_dir=$1
  shift
  local srun_cmd=(srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1
    "${SRUN_EXTRA[@]}" "$@")
  mechmon_log "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $SLURM_NNODES nodes," \
    "rendezvous $MASTER_ADDR:$MASTER_PORT, alarm directory $alarm_dir"
  if [[ "$MECHMON_DRY_RUN" == 1 ]]; then
    mechmon_run "${srun_cmd[@]}"
    mechmon_print_node_commands "$@"
    exit 0
  fi
  mkdir -p "$alarm_dir"
  local rc=0 status=0
  MECHMON_STAMP="$(mktemp "$alarm_dir/.mechmon_attempt.XXXXXX")"
  trap 'rm -f "$MECHMON_STAMP"' EXIT
  mechmon_srun_and_wait "${srun_cmd[@]}" || rc=$?
  mechmon_finish "$rc" "$alarm_dir" "$MECHMON_STAMP" || status=$?
  exit "$status"
}
