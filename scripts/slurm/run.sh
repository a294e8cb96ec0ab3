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
head_ip=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${MAIN_PROCESS_PORT:-29500}
mkdir -p logs

# --signal=B:USR1@600 lands here, in the batch shell. Signal only the training ranks: their
# handler saves a checkpoint at the next step boundary and exits 0. Signalling torchrun instead
# would make it kill the ranks after 30 s, too soon for a ~1 TB save.
save_and_requeue() {
  echo "$(date -Is) time limit near: asking every rank to save, then requeueing job $SLURM_JOB_ID"
  srun --overlap --ntasks-per-node=1 pkill -USR1 -f -- "$RANK_PATTERN" || true
  wait "$training_pid" || true
  scontrol requeue "$SLURM_JOB_ID"
}
trap save_and_requeue USR1

srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c "
  accelerate launch --config_file $accelerate_config \
    --machine_rank \$SLURM_NODEID --main_process_ip $head_ip --main_process_port $port \
    recipes/pretrain.py --config $recipe --resume auto $*
" &
training_pid=$!
wait "$training_pid"
