#!/usr/bin/env bash
# Shared body of the sbatch files: one `accelerate launch` per node, a save-and-requeue before the
# time limit, and automatic resume (resume_from_checkpoint: auto) when the job starts again.
#   usage (from an sbatch file): source scripts/slurm/run.sh ACCELERATE_CONFIG RECIPE [--key value ...]
set -euo pipefail
accelerate_config=$1
recipe=$2
shift 2

# The ranks' command lines (torchrun starts them as `python -u recipes/pretrain.py ...`); neither the
# launcher nor torchrun matches. Dataloader workers match but ignore the signal.
RANK_PATTERN='python[^ ]* -u [^ ]*recipes/pretrain\.py'

# The controller may be failing over or slow for a moment: under `set -e` one failed scontrol ended the batch shell,
# and with it the job (a requeue never asked for). Each call is tried for about a minute.
scontrol_retried() {
  local attempt
  for attempt in 1 2 3 4 5 6; do
    scontrol "$@" && return 0
    echo "$(date -Is) scontrol $1 failed (attempt $attempt of 6); retrying" >&2
    sleep "${PRETRAIN_SCONTROL_RETRY_S:-10}"
  done
  return 1
}

# A run saved and stopped is requeued, unless a person asked for a stop for good: `touch logs/.stop-JOBID` before
# `scancel --signal=TERM JOBID` (or before the time limit). Each start removes the file: it holds for one start.
no_requeue_file="$PWD/logs/.stop-${SLURM_JOB_ID:-0}"
requeue_saved() {
  if [ -e "$no_requeue_file" ]; then
    echo "$(date -Is) saved and stopped; not requeued: $no_requeue_file asks for a stop"
  else
    echo "$(date -Is) saved and stopped: requeueing job $SLURM_JOB_ID"
    scontrol_retried requeue "$SLURM_JOB_ID"
  fi
}

# Set first: a signal during the minute of set-up below (scontrol, recipes.nodes) would end the batch shell.
training_pid=""  # set once the ranks' step is started (a signal before then has nothing to save)
# --signal=B:USR1@600 lands here, in the batch shell. Signal only the training ranks: their
# handler saves a checkpoint at the next step boundary and exits 0. (torchrun, under recipes.launch,
# ignores SIGTERM: bare, it would kill the ranks 30 s later, too soon for a ~1 TB save.)
save_and_requeue() {
  if [ -z "$training_pid" ]; then  # nothing to save, and too little time left to start: the next start goes on
    echo "$(date -Is) time limit near before the ranks started: requeueing job $SLURM_JOB_ID"
    scontrol_retried requeue "$SLURM_JOB_ID"
    exit 0
  fi
  echo "$(date -Is) time limit near: asking every rank to save, then requeueing job $SLURM_JOB_ID"
  # On each node, the ranks of this job only (their environment names it): another job's ranks are left alone.
  # Bounded: a controller slow to create the step must not hold the save past the time limit (a TIMEOUT is never
  # requeued). 90 s leaves a 70B step and save (~483 s as modelled) inside the 600 s; past it the job is requeued at
  # once, losing the steps since the last checkpoint rather than the job.
  local signalled=0
  timeout 90 srun --overlap --nodes="$nodes" --nodelist="$nodelist" --ntasks="$nodes" --ntasks-per-node=1 bash -c '
    for pid in $(pgrep -f -- "$1"); do
      tr "\0" "\n" < "/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_JOB_ID=$2" && kill -USR1 "$pid"
    done
    true
  ' signal "$RANK_PATTERN" "$SLURM_JOB_ID" || signalled=$?
  if (( signalled != 0 )); then
    echo "$(date -Is) could not signal the ranks (srun: exit $signalled): requeueing job $SLURM_JOB_ID now; the" \
      "next start resumes from the last checkpoint"
    scontrol_retried requeue "$SLURM_JOB_ID"
    exit 0
  fi
  trap_code=0
  wait "$training_pid" || trap_code=$?
  if (( trap_code == 0 )); then
    requeue_saved  # saved and stopped (a run that finished meanwhile exports once more)
  elif is_failure "$trap_code"; then
    requeue_after_failure "$trap_code"
  else
    echo "$(date -Is) exit $trap_code: not requeued (2 bad input, 3 training fault, 4 failed save: docs/run-safety.md)"
  fi
}
trap save_and_requeue USR1

# Slurm's --requeue covers preemption and node failure, not exit codes. A hang ended by the watchdog or a crash (1), a
# stalled data source (5), or a process killed by a signal (128+N: srun's code when one node's failure made it kill the
# others, stuck in a collective) is worth another start; at most PRETRAIN_FAILURE_REQUEUES of them in a row (default
# 3, counted in logs/), then the job ends failed for a person to look at. 2-4 fail the same way every time: never
# requeued. In a row: a failure after a newer checkpoint than at the one before starts the count again (counted per
# job, a run of weeks ended at its fourth crash ever, however much it trained between them).
is_failure() { (( $1 == 1 || $1 == 5 || $1 >= 128 )); }
requeue_after_failure() {
  local count_file="logs/.failure-requeues-${SLURM_JOB_ID}" count=0 seen="" limit=${PRETRAIN_FAILURE_REQUEUES:-3}
  local progress
  progress=$(cat "${output_dir:-/nonexistent}/latest" 2>/dev/null || echo none)
  { read -r count seen < "$count_file"; } 2>/dev/null || true
  [[ $count =~ ^[0-9]+$ ]] || count=0
  if [ -n "$seen" ] && [ "$seen" != "$progress" ]; then
    echo "$(date -Is) $progress since the last failure ($seen): the failures are counted again from 0"
    count=0
  fi
  if (( count >= limit )); then
    echo "$(date -Is) exit $1: not requeued: job $SLURM_JOB_ID was requeued after $count failure(s) already"
    return
  fi
  echo "$((count + 1)) $progress" > "$count_file"
  echo "$(date -Is) exit $1 (1 a hang or a crash, 5 a stalled data source, 128+ killed): requeueing job $SLURM_JOB_ID," \
    "failure $((count + 1)) of $limit"
  scontrol_retried requeue "$SLURM_JOB_ID"
}

# The head node's address as Slurm knows it (NodeAddr), not its name, which need not resolve.
# (awk reads to the end: `head` could exit before scontrol has written, a SIGPIPE that pipefail makes fatal)
head_node=$(scontrol_retried show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')
head_ip=$(scontrol_retried show node "$head_node" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
# A requeued start may land on the same head node while the previous start's rendezvous port is still held (a node
# failure kills without a clean close): each start takes the next port. Jobs that share a node (no --exclusive) take
# ports by job id: 16 for each, from 20000, below Linux's ephemeral ports (32768 on; outgoing connections hold those):
# two jobs collide only when their ids are a multiple of 760 apart and they share a node.
job_number=${SLURM_JOB_ID:-}; job_number=${job_number//[^0-9]/}
port=$(( ${MAIN_PROCESS_PORT:-$(( 20000 + 10#${job_number:-0} % 760 * 16 ))} + ${SLURM_RESTART_COUNT:-0} % 16 ))
# Elastic: a job submitted with --nodes=1-2 may start on fewer nodes than the accelerate config names (a node failed
# and the job was requeued). Launch on the nodes this start was given, with the config's processes per node; the
# recipe (elastic: true) keeps the global batch and converts the checkpoint when the world size changed.
config_value() { grep -E "^$1:" "$accelerate_config" | awk 'NR == 1 {print $2}'; }
per_node=$(( $(config_value num_processes) / $(config_value num_machines) ))
given=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
# An elastic recipe trains on the most of these nodes that keep its global batch (6 given, 128 rows: 4 train).
nodes=$(python -m recipes.nodes "$recipe" --given "$given" --per-node "$per_node" "$@" 2>/dev/null || echo "$given")
output_dir=$(python -m recipes.nodes "$recipe" --output-dir "$@" 2>/dev/null || true)  # its `latest`: progress
echo "$(date -Is) job ${SLURM_JOB_ID:-?} start ${SLURM_RESTART_COUNT:-0}: $nodes node(s) x $per_node process(es)" \
  "$([ "$nodes" = "$given" ] || echo "($given given: the global batch is kept on $nodes; the others wait)")"
# The first $nodes nodes of the job, the head among them: their SLURM_NODEID are the machine ranks 0..nodes-1.
nodelist=$(scontrol_retried show hostnames "$SLURM_JOB_NODELIST" | awk -v n="$nodes" 'NR <= n' | paste -sd, -)

# The recipe's overrides reach pretrain.py word for word ("$@", not $* inside a string: `--lr_scheduler_kwargs
# '{min_lr: 0}'` stays one argument). SLURM_NODEID is expanded by each node's task, hence the single quotes.
# One task per node, with all the CPUs this job has there (the allocation's tasks may sit two on one node).
# The machine rank is the node's place in $nodelist, whose first node is the head: Slurm's SLURM_NODEID follows the
# order of slurm.conf, which need not be the sorted order of the job's node list (rank 0 would then start the
# rendezvous on a node that is not the head, and no start would ever form).
# recipes.launch is `accelerate launch` that exits with the ranks' own code (docs/run-safety.md), which Slurm records.
# Under a preemption with GraceTime Slurm signals the steps, not this shell, and requeues the job only if it is still
# running when the grace time ends: ranks that saved and exited 0 in time would end it COMPLETED. They say so in this
# file (recipes.launch.mark_stopped), and the job is requeued below. A plain scancel signals this shell too, which it
# ends: a cancelled job stays cancelled.
stopped_file="$PWD/logs/.stopped-${SLURM_JOB_ID:-0}"
rm -f "$stopped_file" "$no_requeue_file"
export PRETRAIN_STOPPED_FILE="$stopped_file"
# The fewest CPUs the job has on any node (SLURM_JOB_CPUS_PER_NODE: "128(x2),96"): the batch host's count asked every
# node for as many, and a node with fewer made every start fail (exit 1) on a cluster of mixed nodes.
cpus=$(tr , '\n' <<< "${SLURM_JOB_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}}" | sed 's/(.*//' | sort -n | awk 'NR == 1')
srun --kill-on-bad-exit=1 --nodes="$nodes" --nodelist="$nodelist" --ntasks="$nodes" --ntasks-per-node=1 --cpus-per-task="${cpus:-1}" bash -c '
  place=$(tr , "\n" <<< "$7" | grep -nxF -- "${SLURMD_NODENAME:-}" | cut -d: -f1)
  exec python -m recipes.launch --config_file "$1" --num_machines "$5" --num_processes "$6" \
    --machine_rank "$(( ${place:-$(( SLURM_NODEID + 1 ))} - 1 ))" --main_process_ip "$2" --main_process_port "$3" \
    recipes/pretrain.py --config "$4" --resume auto --metrics_host 0.0.0.0 "${@:8}"
' run.sh "$accelerate_config" "$head_ip" "$port" "$recipe" "$nodes" "$((nodes * per_node))" "$nodelist" "$@" &
training_pid=$!
code=0
wait "$training_pid" || code=$?
# after the time limit's signal, `wait` returned 128+10 and the trap has the ranks' own code
[ -n "${trap_code:-}" ] && exit "$trap_code"
ls "$PWD/logs" > /dev/null 2>&1 || true  # an NFS client may hold a stale "no such file" for the head node's write
if (( code == 0 )) && [ -e "$stopped_file" ]; then
  echo "$(date -Is) the ranks saved and stopped on a signal (a preemption?)"
  rm -f "$stopped_file"
  requeue_saved
elif is_failure "$code"; then
  requeue_after_failure "$code"
fi
exit "$code"
