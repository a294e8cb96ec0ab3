"""`accelerate launch` with the run's own exit code, a stop that saves first, and a bad input said in one line.

    python -m recipes.launch --config_file accelerate_configs/zero3_8gpu.yaml recipes/pretrain.py --config ...

Takes exactly `accelerate launch`'s arguments. Launched bare, `accelerate launch` (torchrun inside it) exits 1
whatever the ranks exited with, prints a 35-line traceback after a rank's one-line bad-input error, and on SIGTERM
signals the ranks and SIGKILLs them 30 s later, before a 70B save (~233 s) can finish, then exits 143. This wrapper:

- exits with the ranks' own code (docs/run-safety.md's table): each rank records the code its `main` returned
  (`write_exit_code`), and the run's code is rank 0's, else the first other failing rank's; a rank that left no
  code (killed, a crash's traceback, the hang watchdog's exit) makes it the launcher's, which is 1 then;
- on SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) signals the ranks alone, so they save at the next step boundary and exit
  0 (the launcher runs in a session of its own: a terminal's Ctrl-C reaches the wrapper only); a second SIGINT
  kills the whole launch at once;
- keeps torchrun from acting on a SIGTERM of its own: Slurm's preemption and `scancel` signal every process of a
  job step, torchrun too, which then killed the ranks 30 s later, mid-save; the ranks got the signal as well, and
  Slurm's grace time, not torchrun's 30 s, now bounds their save;
- passes every line of output through as it comes, except torchrun's `ChildFailedError` traceback, which it
  replaces with one line naming each rank's code (a rank's own traceback is kept).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

EXIT_CODE_DIR_ENV = "PRETRAIN_EXIT_CODE_DIR"  # where each rank writes the code its main returned
MEANING = {0: "finished, or saved and stopped", 1: "hang, crash or killed: requeue", 2: "bad input",
           3: "training fault", 4: "failed save", 5: "stalled data"}  # fmt: skip
TRACEBACK = b"Traceback (most recent call last):\n"
LAUNCHER_FAILURE = re.compile(rb"torch\.distributed\.elastic\.multiprocessing\.errors\.ChildFailedError")


def write_exit_code(code: int) -> int:
    """Record this rank's exit code for the wrapper (when it launched the run); returns `code`."""
    directory = os.environ.get(EXIT_CODE_DIR_ENV)
    if directory:
        # on failure the code still reaches torchrun, and the wrapper reports the launcher's
        with contextlib.suppress(OSError):
            Path(directory, f"rank-{os.environ.get('RANK', '0')}").write_text(f"{code}\n")
    return code


STOPPED_FILE_ENV = "PRETRAIN_STOPPED_FILE"  # set by scripts/slurm/run.sh


def mark_stopped() -> int:
    """Say that the run saved and stopped on a signal rather than finished (returns its exit code, 0): rank 0 writes
    $PRETRAIN_STOPPED_FILE when it is set. Slurm requeues a preempted job only if it still runs when its GraceTime
    ends, so one whose ranks saved and exited 0 in time ended COMPLETED, never to run again: the batch script
    requeues it on this file."""
    path = os.environ.get(STOPPED_FILE_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        with contextlib.suppress(OSError):  # the script then ends the job as finished: the checkpoint is complete
            Path(path).write_text("saved and stopped on a signal\n")
    return 0


def read_exit_codes(directory: Path) -> dict[int, int]:
    codes = {}
    for path in directory.glob("rank-*"):
        try:
            codes[int(path.name.removeprefix("rank-"))] = int(path.read_text())
        except ValueError:
            continue
    return codes


def run_exit_code(rank_codes: dict[int, int], local_ranks: int | None, launcher_code: int) -> int:
    """The run's code on this node: its lowest failing rank's; 0 when every rank it started recorded 0 (the launcher
    may still say 1, or die of the SIGTERM Slurm sends every process of a job step after the ranks saved); the
    launcher's otherwise (a rank recorded nothing: killed, crashed), at least 1."""
    failing = sorted(rank for rank, code in rank_codes.items() if code != 0)
    if failing:
        return rank_codes[failing[0]]
    if rank_codes and (len(rank_codes) >= local_ranks if local_ranks else launcher_code == 0):
        return 0
    return launcher_code if launcher_code > 0 else 1


class LauncherTracebackFilter:
    """Bytes of the launch's stderr in, bytes to print out: everything as it comes (a progress bar's partial lines
    too), except torchrun's traceback that ends in `ChildFailedError` and the table of ranks after it, which the
    launcher prints last. A traceback is held from its first line to its exception line, which says whose it is:
    any other traceback (a rank's) then goes out whole."""

    def __init__(self):
        self.held: list[bytes] = []  # the lines of a traceback, while it is not known whose it is
        self.swallowing = False  # inside torchrun's block: to the end of the output
        self.partial = b""  # the start of a line that may be a traceback's first
        self.at_line_start = True
        self.dropped = False
        self.swallowed: list[bytes] = []  # torchrun's block (its table names the ranks a signal killed)

    def feed(self, chunk: bytes) -> bytes:
        data, self.partial = self.partial + chunk, b""
        out: list[bytes] = []
        *complete, last = data.split(b"\n")  # not splitlines: a progress bar's \r does not end a line
        for line in [piece + b"\n" for piece in complete] + ([last] if last else []):
            if self.swallowing:
                if len(self.swallowed) < 2000:
                    self.swallowed.append(line)
                continue
            if not line.endswith(b"\n"):  # the output's last, partial line
                if self.held or (self.at_line_start and TRACEBACK.startswith(line)):
                    self.partial = line  # decided when the line is complete
                else:
                    out.append(line)
                    self.at_line_start = False
                continue
            if self.held:
                self.held.append(line)
                if not line[:1].isspace():  # the exception line
                    if LAUNCHER_FAILURE.search(line):
                        self.swallowing, self.dropped, self.held = True, True, []
                    else:
                        out += self.held
                        self.held = []
            elif self.at_line_start and line == TRACEBACK:
                self.held = [line]
            else:
                out.append(line)
            self.at_line_start = True
        return b"".join(out)

    def close(self) -> bytes:
        """What is left at the end of the output (a traceback cut short goes out as it is)."""
        rest = b"" if self.swallowing else b"".join(self.held) + self.partial
        self.held, self.partial = [], b""
        return rest


KILLED_RANK = re.compile(rb"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*-(\d+)")


def killed_ranks(torchrun_block: bytes) -> dict[int, str]:
    """The ranks torchrun's failure table says a signal ended (exitcode -N), by global rank: what a rank that the
    kernel's out-of-memory killer took (SIGKILL) leaves, since it records no code of its own."""
    killed = {}
    for rank, number in KILLED_RANK.findall(torchrun_block):
        try:
            name = signal.Signals(int(number)).name
        except ValueError:
            name = f"signal {int(number)}"
        killed[int(rank)] = name
    return killed


def ranks_said(rank_codes: dict[int, int], killed: dict[int, str]) -> str:
    """The ranks' codes, and the ranks a signal killed, for the launch's last line."""
    said = {rank: str(code) for rank, code in rank_codes.items()}
    for rank, name in killed.items():
        said.setdefault(rank, f"killed by {name}" + (" (out of memory? see dmesg)" if name == "SIGKILL" else ""))
    return ", ".join(f"rank {rank}: {value}" for rank, value in sorted(said.items())) or "none recorded"


def local_ranks_of(argv: list[str]) -> int | None:
    """The processes this launch starts on its node: `--num_processes` / `--num_machines`, from the arguments or else
    the `--config_file` YAML (None when neither says)."""
    values = {}
    for key in ("num_processes", "num_machines", "config_file"):
        for index, argument in enumerate(argv):
            if argument == f"--{key}" and index + 1 < len(argv):
                values[key] = argv[index + 1]
            elif argument.startswith(f"--{key}="):
                values[key] = argument.split("=", 1)[1]
    if "config_file" in values and Path(values["config_file"]).is_file():
        import yaml

        try:
            from_file = yaml.safe_load(Path(values["config_file"]).read_text()) or {}
        except yaml.YAMLError:
            from_file = {}
        for key in ("num_processes", "num_machines"):
            values.setdefault(key, str(from_file.get(key, "")))
    processes, machines = values.get("num_processes", ""), values.get("num_machines", "") or "1"
    if not (processes.isdigit() and machines.isdigit()) or int(machines) < 1:
        return None
    return max(1, int(processes) // int(machines))


def signal_ranks(launcher_pid: int, sig: int) -> int:
    """Send `sig` to every process under the launcher (the ranks; their dataloader workers ignore it), not to the
    launcher, which would kill them 30 s later. Returns how many were signalled."""
    import psutil

    try:
        below = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    for process in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(sig)
    return len(below)


# torchrun stops the ranks on each signal its --signals-to-handle names (PET_SIGNALS_TO_HANDLE), SIGKILL 30 s later.
# Left out of that list, SIGTERM would end the launcher at once (its default action), so the launcher gets a handler
# that does nothing: a Python handler, not SIG_IGN, because an exec resets a handler but keeps SIG_IGN, and the ranks
# must start with SIGTERM's default action until they install their own (a rank ignoring an early one would train on).
LAUNCHER_PROGRAM = ("import signal, sys; signal.signal(signal.SIGTERM, lambda signum, frame: None); "
            "sys.argv[0] = 'accelerate launch'; from accelerate.commands.launch import main; main()")  # fmt: skip


TORCHRUN_SIGNALS_ENV = "PET_SIGNALS_TO_HANDLE"  # torchrun's default for --signals-to-handle


def torchrun_signals(environ: dict[str, str]) -> str:
    """The signals torchrun may act on: the caller's choice, or torchrun's default, less SIGTERM."""
    named = environ.get(TORCHRUN_SIGNALS_ENV, "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")
    kept = ",".join(name.strip() for name in named if name.strip() and name.strip() != "SIGTERM")
    return kept or "SIGINT"  # torchrun reads an empty list as one signal named "" (a warning)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    from common.process import die_with_parent, kill_tree

    with tempfile.TemporaryDirectory(prefix="pretrain-exit-") as codes_dir:
        env = {**os.environ, EXIT_CODE_DIR_ENV: codes_dir, TORCHRUN_SIGNALS_ENV: torchrun_signals(os.environ)}
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER_PROGRAM, *argv], env=env,
                                    stderr=subprocess.PIPE, start_new_session=True,
                                    preexec_fn=die_with_parent)  # fmt: skip
        interrupts = []

        def forward(signum, frame):
            if signum == signal.SIGINT and interrupts:  # a second Ctrl-C: stop now, unsaved
                kill_tree(launcher.pid)
                return
            interrupts.append(signum)
            stop = signal.SIGTERM if signum == signal.SIGINT else signum
            count = signal_ranks(launcher.pid, stop)
            print(
                f"launch: {signal.Signals(signum).name}: asked {count} process(es) of the run to save and stop "
                f"({signal.Signals(stop).name}); a second Ctrl-C stops them unsaved",
                file=sys.stderr,
                flush=True,
            )

        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, forward)
        stderr = LauncherTracebackFilter()
        while chunk := os.read(launcher.stderr.fileno(), 65536):
            sys.stderr.buffer.write(stderr.feed(chunk))
            sys.stderr.buffer.flush()
        sys.stderr.buffer.write(stderr.close())
        sys.stderr.buffer.flush()
        launcher_code = launcher.wait()
        rank_codes = read_exit_codes(Path(codes_dir))
    code = run_exit_code(rank_codes, local_ranks_of(argv), launcher_code)
    if code or stderr.dropped:
        ranks = ranks_said(rank_codes, killed_ranks(b"".join(stderr.swallowed)))
        print(f"launch: exit {code} ({MEANING.get(code, 'see the log above')}); the ranks' codes: {ranks}",
              file=sys.stderr)  # fmt: skip
    return code


if __name__ == "__main__":
    sys.exit(main())
