"""Cleaning before tokenization, on datatrove: quality filters, then near-duplicate removal across every input file.

    python -m data_prep.clean --input 'raw/*.jsonl.zst' --output cleaned/ [--config my_clean.yaml] [--workers 32]
    python -m data_prep.preprocess --input 'cleaned/data/*.jsonl.zst' ...

Reads what data_prep.preprocess reads (jsonl, .gz, .zst, parquet; --text-field) and writes `OUT/data/*.jsonl.zst`
(one shard per task, in input order; `text` plus the source file and line of each document), `clean_report.json`
and `clean_report.md`. Which filters run and their thresholds come from a YAML (default:
data_prep/cleaning/default.yaml). Nothing is downloaded. A killed run continues with the same command; one output
is written by one run at a time. `--executor slurm` submits the stages as dependent job arrays instead
(docs/data-cleaning.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Before datatrove (and huggingface_hub under it) is imported: nothing in this stage may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="files or globs: jsonl/parquet/txt, .gz or .zst")
    parser.add_argument("--output", required=True, help="output directory (created; continued if interrupted)")
    parser.add_argument("--config", help="YAML of filters and dedup (default: data_prep/cleaning/default.yaml)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tasks run at once (local executor)")
    parser.add_argument("--tasks", type=int, help="shards of the work and of the output (default: one per input file)")
    parser.add_argument("--text-field", default="text", help="jsonl field / parquet column holding the text")
    parser.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")
    parser.add_argument("--skip-corrupt-files", action="store_true",
                        help="go on past a truncated or corrupt archive (what was read of it is kept)")  # fmt: skip
    parser.add_argument("--keep-removed", action="store_true",
                        help="also write every removed document to OUT/removed/<filter>/ (for an audit)")  # fmt: skip
    parser.add_argument("--executor", choices=("local", "slurm"), default="local")
    slurm = parser.add_argument_group("slurm (with --executor slurm; run from the submit host)")
    slurm.add_argument("--partition", help="partition for every stage's jobs")
    slurm.add_argument("--time", default="24:00:00", help="time limit of each job")
    slurm.add_argument("--cpus-per-task", type=int, default=1)
    slurm.add_argument("--mem-per-cpu-gb", type=int, default=2)
    slurm.add_argument("--qos", help="quality of service for the jobs")
    slurm.add_argument("--venv", help="bin/activate of the environment the nodes run (default: this one's)")
    slurm.add_argument("--wait", action="store_true", help="wait until the last stage has ended")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    return parser.parse_args(argv)


def build_job(args: argparse.Namespace):
    from data_prep.cleaning.config import CleanConfigError, load_clean_config
    from data_prep.cleaning.runner import CleanError
    from data_prep.cleaning.stages import CleanJob
    from data_prep.pipeline import check_inputs
    from data_prep.progress import PreprocessError

    if args.workers < 1 or (args.tasks is not None and args.tasks < 1):
        raise CleanError("--workers and --tasks must be positive")
    if args.executor == "slurm" and not args.partition:
        raise CleanError("--executor slurm needs --partition")
    try:
        config = load_clean_config(args.config)
        files = check_inputs(args.input, args.text_field)
    except (CleanConfigError, PreprocessError) as error:
        raise CleanError(str(error)) from None
    tasks = args.tasks or len(files)
    return CleanJob(str(Path(args.output).resolve()), tuple(files), config, tasks, args.text_field, args.strict,
                    args.skip_corrupt_files, args.keep_removed)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from common.lock import DirectoryLock, LockedError
    from data_prep.cleaning.report import REPORT_JSON, REPORT_MD, summary_table
    from data_prep.cleaning.runner import (
        CleanError,
        SlurmOptions,
        live_slurm_jobs,
        prepare,
        run_local,
        submit_slurm,
        task_error,
    )
    from data_prep.cleaning.stages import remove_intermediates

    job = build_job(args)
    try:
        lock = DirectoryLock(job.out, "cleaning run").acquire()
    except LockedError as error:
        raise CleanError(f"--output {error}") from None
    try:
        if prepare(job):
            remove_intermediates(job.work)  # again: a kill may have come between the report and their removal
            print(f"{job.out} is already complete (same settings and inputs); nothing to do")
            return 0
        live = live_slurm_jobs(job.work)
        if live:
            raise CleanError(f"--output {job.out} is being cleaned by Slurm job(s) {', '.join(live)}; wait for them "
                             "to end or scancel them")  # fmt: skip
        if args.executor == "local":
            run_local(job, args.workers)
        else:
            options = SlurmOptions(args.partition, args.time, args.cpus_per_task, args.mem_per_cpu_gb, args.venv,
                                   args.qos)  # fmt: skip
            submit_slurm(job, options)
    finally:
        lock.release()
    if args.executor == "slurm" and args.wait:
        while live_slurm_jobs(job.work):
            time.sleep(5)
    report = Path(job.out) / REPORT_JSON
    if not report.exists():
        if args.executor == "slurm" and not args.wait:
            print(f"submitted; {report} appears when the last stage ends (logs: {job.work / 'stages'})")
            return 0
        raise CleanError(task_error(job.work) or f"the run ended without its report; see the logs under "
                         f"{job.work / 'stages'}")  # fmt: skip
    finished = json.loads(report.read_text())
    print("\n".join(summary_table(finished)))
    print(
        f"done: {finished['read']['docs_out']:,} documents in, {finished['output']['docs']:,} kept in "
        f"{Path(job.out) / 'data'} (report: {Path(job.out) / REPORT_MD})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        import datatrove  # noqa: F401
        import spacy  # noqa: F401
    except ImportError as error:
        print(f"error: data_prep.clean needs {error.name}: pip install -e '.[clean]'", file=sys.stderr)
        return 2
    from data_prep.cleaning.runner import CleanError

    try:
        return run(args)
    except CleanError as error:
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
