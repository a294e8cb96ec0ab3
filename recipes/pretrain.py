"""Pretrain a Llama-style model with Accelerate and DeepSpeed ZeRO-3.

    accelerate launch --config_file accelerate_configs/zero3_8gpu.yaml recipes/pretrain.py \
        --config recipes/configs/llama70b_a800x8.yaml [--key value ...]

(`python -m recipes.launch` in place of `accelerate launch` exits with the code below and saves on SIGTERM.)

Reads in the order of the run: parse -> check -> build -> fit -> export. `--help` lists every recipe key.
Exit codes: 0 done, or saved and stopped; 1 hang watchdog, 2 bad input, 3 training fault, 4 failed save, 5 stalled data.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script by `accelerate launch recipes/pretrain.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.process import die_with_parent, stacks_on_request
from recipes.config import ConfigError, parse_cli

logger = logging.getLogger("pretrain")


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    die_with_parent()  # torchrun gives each rank a session of its own: nothing else ends it with the launcher
    stacks_on_request()  # SIGUSR2: every thread's stack in the log, the run going on (docs/troubleshooting.md)
    # Dataloader workers are forked after this process has tokenized: the tokenizer's thread pool must never
    # have started, or a forked worker deadlocks inside it (whatever the shell exported).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        config = parse_cli(argv, "recipes/pretrain.py", __doc__.split("\n\n")[0])
    except ConfigError as error:
        return report_error(error)
    # torch and DeepSpeed are imported only now, so that --help and a bad config answer at once
    from recipes.export import ExportInterrupted, export_run, record_run
    from recipes.launch import mark_stopped
    from recipes.training.checkpointing import CheckpointError
    from recipes.training.exit_codes import run_exit
    from recipes.training.run_state import StopReason
    from recipes.training.startup import check_launch
    from recipes.training.trainer import build_trainer

    try:
        launch = check_launch(config)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as error:
        return report_error(error, config)
    trainer = build_trainer(config, launch, started)

    code = None  # a crash (a traceback) has no code to serve: Prometheus sees the endpoint go as a dead run's
    try:
        stop = trainer.fit()
        logger.info("training stopped after %d steps: %s", trainer.state.step, stop)
        if stop.reason is StopReason.STOP_SIGNAL:  # a stopped run is continued later, not exported
            record_run(config, launch, trainer, stop)
        else:
            export_run(config, launch, trainer, stop)
        code = mark_stopped() if stop.reason is StopReason.STOP_SIGNAL else 0  # a batch script requeues a stopped run
    except ExportInterrupted as interrupted:  # the checkpoint is complete: a relaunch exports final/ again
        logger.warning("%s", interrupted)
        code = mark_stopped()
    except Exception as error:
        named = run_exit(error, config.output_dir)  # the exit codes' table; None: a bug, a traceback and 1
        if named is None:
            raise
        code, said = named
        logger.error("%s", said)
    finally:
        trainer.accelerator.end_training()  # finishes the trackers' runs
        trainer.metrics.close(code, config.metrics_linger_s)  # the endpoint says how the run ended, then goes
    return code


def report_error(error: Exception, config=None) -> int:
    """A user's mistake: one line on the main process, exit code 2, no traceback; the first rank of every other node
    names its host (a check failing on one node only is otherwise said nowhere); served as a run's end is."""
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if rank == 0:
        print(f"error: {error}", file=sys.stderr)
    elif local_rank == 0:
        print(f"error: {error} (on {socket.gethostname()}, rank {rank})", file=sys.stderr)
    if config is not None and config.prometheus_port is not None:  # a failed run to monitoring, not a lost node
        from recipes.telemetry.monitoring import serve_exit_code

        serve_exit_code(config.prometheus_port, config.metrics_host, 2, config.metrics_linger_s)
    return 2


if __name__ == "__main__":
    from common.process import run_as_rank
    from recipes.launch import write_exit_code  # for `python -m recipes.launch`, which exits with the ranks' code

    run_as_rank(lambda: write_exit_code(main()))  # not sys.exit: see run_as_rank (a gloo abort at finalization)
