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
# The head node's address as Slurm knows it (NodeAddr), not its name, which need not resolve.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
head_ip=$(scontrol show node "$head_node" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
port=${MAIN_PROCESS_PORT:-29500}

# --signal=B:USR1@600 lands here, in the batch shell. Signal only the training ranks: their
# handler saves a checkpoint at the next step boundary and exits 0. Signalling torchrun instead
# would make it kill the ranks after 30 s, too soon for a ~1 TB save.
save_and_requeue() {
  echo "$(date -Is) time limit near: asking every rank to save, then requeueing job $SLURM_JOB_ID"
  # On each node, the ranks of this job only (their environment names it): another job's ranks are left alone.
  srun --overlap --ntasks-per-node=1 bash -c '
    for pid in $(pgrep -f -- "$1"); do
      tr "\0" "\n" < "/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_JOB_ID=$2" && kill -USR1 "$pid"
    done
  ' signal "$RANK_PATTERN" "$SLURM_JOB_ID" || true
  wait "$training_pid" || true
  scontrol requeue "$SLURM_JOB_ID"
}
trap save_and_requeue USR1

# The recipe's overrides reach pretrain.py word for word ("$@", not $* inside a string: `--lr_scheduler_kwargs
# '{min_lr: 0}'` stays one argument). SLURM_NODEID is expanded by each node's task, hence the single quotes.
srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c '
  exec accelerate launch --config_file "$1" --machine_rank "$SLURM_NODEID" --main_process_ip "$2" \
    --main_process_port "$3" recipes/pretrain.py --config "$4" --resume auto --metrics_host 0.0.0.0 "${@:5}"
' run.sh "$accelerate_config" "$head_ip" "$port" "$recipe" "$@" &
training_pid=$!
wait "$training_pid"
