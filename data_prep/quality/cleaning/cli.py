"""Cleaning before tokenization, on datatrove: quality filters, then near-duplicate removal across every input file.

    python -m data_prep.clean --input 'raw/*.jsonl.zst' --output cleaned/ [--preset curated | --config my.yaml] \
        [--workers 32]
    python -m data_prep.preprocess --input 'cleaned/data/*.jsonl.zst' ...
    python -m data_prep.clean --list-filters    # every filter's arguments, defaults and what each preset sets

Reads what data_prep.preprocess reads (jsonl, .gz, .zst, parquet; --text-field) and writes `OUT/data/*.jsonl.zst`
(one shard per task, in input order; `text` plus the source file and line of each document), `clean_report.json`
and `clean_report.md`. Which filters run and their thresholds come from a YAML: `--preset web` (the default,
data_prep/quality/cleaning/default.yaml: crawled pages), `--preset curated` (curated.yaml: books, documentation,
technical text with code and markup), or your own (`--config`). A run that removes more than half of the bytes, or a
filter that removes more than a third of what it sees, ends with a warning naming the filter, its reason and the fix.
Nothing is downloaded. A killed run continues with the same command; one output is written by one run at a time.
`--executor slurm` submits the stages as dependent job arrays instead (docs/data-cleaning.md).

Exit codes: 0 done; 1 a task died or crashed (run the same command again); 2 bad input, or an output with no
document (a person must act); 4 the output's disk is full (make room, then the same command continues).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from common.exit_codes import OneLineParser
from data_prep.quality.cleaning.config import PRESETS  # yaml only: datatrove is imported in main, offline


def stay_offline() -> None:
    """Before datatrove (and huggingface_hub under it) is imported: nothing in this stage may reach the network. In
    main, not at import: a process that imports this module for one function keeps its own hub setting."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", help="files or globs: jsonl/parquet/txt, .gz or .zst (required)")
    parser.add_argument("--output", help="output directory (created; continued if interrupted; required)")
    parser.add_argument("--preset", choices=tuple(PRESETS),
                        help="shipped filter settings: web (default; crawled pages) or curated (books, documentation, "
                             "technical text with code and markup)")  # fmt: skip
    parser.add_argument("--config", help="your own YAML of filters and dedup, instead of a --preset")
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
    parser.add_argument("--list-filters", action="store_true",
                        help="print each filter's arguments, defaults and presets' values; exit")  # fmt: skip
    args = parser.parse_args(argv)
    if not args.list_filters and not (args.input and args.output):
        parser.error("the following arguments are required: --input, --output")
    return args


def build_job(args: argparse.Namespace):
    from data_prep.quality.cleaning.config import CleanConfigError, load_clean_config
    from data_prep.quality.cleaning.runner import CleanError
    from data_prep.quality.cleaning.stages import CleanJob
    from data_prep.reading.readers import InputError, check_inputs, check_outside_output

    if args.workers < 1 or (args.tasks is not None and args.tasks < 1):
        raise CleanError("--workers and --tasks must be positive")
    if args.executor == "slurm" and not args.partition:
        raise CleanError("--executor slurm needs --partition")
    if args.preset and args.config:
        raise CleanError(f"--preset {args.preset} and --config {args.config}: choose one (a --config is a whole set of "
                         "filters; start it from a preset's YAML under data_prep/quality/cleaning/)")  # fmt: skip
    preset = None if args.config else args.preset or "web"
    try:
        config = load_clean_config(args.config or PRESETS[preset])
        check_outside_output(args.input, Path(args.output))
        files = check_inputs(args.input, args.text_field)
    except (CleanConfigError, InputError) as error:
        raise CleanError(str(error)) from None
    tasks = args.tasks or len(files)
    return CleanJob(str(Path(args.output).resolve()), tuple(files), config, tasks, args.text_field, args.strict,
                    args.skip_corrupt_files, args.keep_removed, preset)  # fmt: skip


def check_output(out: Path) -> None:
    """The output directory can be made, before any work: a path under a file (`--output /etc/passwd/x`), a file,
    a read-only mount or another user's directory was a traceback and exit 1, which a scheduler requeues forever."""
    from data_prep.quality.cleaning.runner import NOT_WRITABLE, CleanError, output_error

    if out.exists() and not out.is_dir():
        raise CleanError(f"--output {out} is a file; choose a directory (it is created)")
    in_the_way = next((parent for parent in out.parents if parent.exists() and not parent.is_dir()), None)
    if in_the_way:
        raise CleanError(f"--output {out}: cannot be created: {in_the_way} is a file")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        if error.errno in NOT_WRITABLE:
            raise CleanError(f"--output {out}: cannot be created ({error.strerror}); choose a directory this user can "
                             "create and write") from None  # fmt: skip
        raise output_error(error, out) or error from None


def parallelism_note(workers: int, tasks: int, files: int) -> str | None:
    """One line when --workers is more than the filter, signature and dedup stages can use: they run one task per
    shard, and a shard reads whole input files (task i reads files i, i + tasks, ...), so one file is one task."""
    busy = min(tasks, files)
    if workers <= busy:
        return None
    spare = f"; {tasks - files} of the {tasks} --tasks get no file" if tasks > files else ""
    return (f"note: --workers {workers}, but the filter, signature and dedup stages have {busy} task(s) with input "
            f"(one per input file: a file is not split{spare}), so they run {busy} process(es) at a time; split the "
            f"input into {workers} or more files to use every worker")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from common.lock import DirectoryLock, LockedError
    from data_prep.quality.cleaning.runner import CleanError, live_slurm_jobs

    job = build_job(args)
    check_output(Path(job.out))
    try:
        lock = DirectoryLock(job.out, "cleaning run").acquire()
    except LockedError as error:
        raise CleanError(f"--output {error}") from None
    try:
        if not start(job, args):
            return 0  # complete already
    finally:
        lock.release()
    if args.executor == "slurm" and args.wait:
        while live_slurm_jobs(job.work):
            time.sleep(5)
    return finish(job, args)


def start(job, args: argparse.Namespace) -> bool:
    """Run the stages (local) or submit them (Slurm); False when the output is complete already. Under the lock."""
    from data_prep.quality.cleaning.report import REPORT_JSON, no_document_kept
    from data_prep.quality.cleaning.runner import (
        CleanError,
        SlurmOptions,
        live_slurm_jobs,
        prepare,
        run_local,
        submit_slurm,
    )
    from data_prep.quality.cleaning.stages import remove_intermediates

    if prepare(job):
        remove_intermediates(job.work)  # again: a kill may have come between the report and their removal
        empty = no_document_kept(json.loads((Path(job.out) / REPORT_JSON).read_text()))
        if empty:
            raise CleanError(empty)
        print(f"{job.out} is already complete (same settings and inputs); nothing to do")
        return False
    live = live_slurm_jobs(job.work)
    if live:
        raise CleanError(f"--output {job.out} is being cleaned by Slurm job(s) {', '.join(live)}; wait for them "
                         "to end or scancel them")  # fmt: skip
    if args.executor == "local":
        note = parallelism_note(args.workers, job.tasks, len(job.files))
        if note:  # with the progress lines on stdout, once nothing refused the run: stderr is for errors
            print(note)
        run_local(job, args.workers)
    else:
        options = SlurmOptions(args.partition, args.time, args.cpus_per_task, args.mem_per_cpu_gb, args.venv,
                               args.qos)  # fmt: skip
        submit_slurm(job, options)
    return True


def finish(job, args: argparse.Namespace) -> int:
    """The summary of a finished run, its warnings, and exit 2 when it kept nothing."""
    from data_prep.quality.cleaning.report import REPORT_JSON, REPORT_MD, no_document_kept, summary_table
    from data_prep.quality.cleaning.runner import CleanCrashed, CleanError, task_error

    report = Path(job.out) / REPORT_JSON
    if not report.exists():
        if args.executor == "slurm" and not args.wait:
            print(f"submitted; {report} appears when the last stage ends (logs: {job.work / 'stages'})")
            return 0
        message = task_error(job.work)
        if message:
            raise CleanError(message)
        raise CleanCrashed(f"the run ended without its report; run the same command again (the logs: "
                           f"{job.work / 'stages'})")  # fmt: skip
    finished = json.loads(report.read_text())
    print("\n".join(summary_table(finished)))
    print(
        f"done: {finished['read']['docs_out']:,} documents in, {finished['output']['docs']:,} kept in "
        f"{Path(job.out) / 'data'} (report: {Path(job.out) / REPORT_MD})"
    )
    empty = no_document_kept(finished)  # also the report's first warning
    for warning in finished.get("warnings", []):  # exit 0 still: the output is complete, perhaps not useful
        if warning != empty:
            print(f"warning: {warning}", file=sys.stderr)
    if empty:  # nothing to train on: almost surely the wrong input, --text-field or config
        raise CleanError(empty)
    return 0


def main(argv: list[str] | None = None) -> int:
    stay_offline()
    args = parse(argv)
    try:
        import datatrove  # noqa: F401
        import spacy  # noqa: F401
    except ImportError as error:
        print(f"error: data_prep.clean needs {error.name}: pip install -e '.[clean]'", file=sys.stderr)
        return 2
    if args.list_filters:
        from data_prep.quality.cleaning.config import filters_table

        print("\n".join(filters_table()))
        return 0
    from data_prep.quality.cleaning.runner import CleanError, output_error

    try:
        try:
            return run(args)
        except OSError as error:  # a full disk, or an output made unwritable, met by this process itself
            raise output_error(error, Path(args.output).resolve()) or error from None
    except CleanError as error:
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":  # the same command by its module path
    sys.exit(main())
