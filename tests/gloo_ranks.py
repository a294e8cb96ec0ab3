"""Run a function on N real ranks of a gloo process group (spawned processes), for the collectives whose point is
what happens when the ranks see different things."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from common.process import run_as_rank


def _rank_main(rank: int, world: int, init_file: str, timeout_s: float, function, args) -> None:
    def main() -> int | None:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))  # fmt: skip
        try:
            return function(rank, *args)
        finally:
            dist.destroy_process_group()

    # as recipes/pretrain.py and the benchmarks end a rank: its code through common.process.exit_process, skipping the
    # interpreter's finalization, in which a gloo worker thread can abort it
    run_as_rank(main)


def on_ranks(function, world: int, workdir: Path, *args, timeout_s: float = 30) -> None:
    """`function(rank, *args)` on each of `world` ranks, each rank exiting with what it returns (None: 0) through
    `common.process.run_as_rank`; a rank that exits otherwise than 0 (an exception, a collective that timed out
    included, gives 1 and its traceback on stderr) raises torch's ProcessExitedException here, with its `exit_code`.
    `function` must be defined at a module's top level (it is pickled by name)."""
    Path(workdir).mkdir(parents=True, exist_ok=True)
    init_file = Path(workdir) / "gloo-init"
    mp.start_processes(_rank_main, args=(world, str(init_file), timeout_s, function, args), nprocs=world,
                       join=True, start_method="spawn")  # fmt: skip
