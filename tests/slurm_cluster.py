"""A real Slurm cluster on this host for the tests: one controller and three compute "nodes" (n1-n3), started in a
scratch directory and stopped by their PID files. Needs Debian's slurm-wlm and munge, and root (.ci/run installs
them); elsewhere the tests that use it are skipped with the reason."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

CONF = """ClusterName=test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=1
ReturnToService=2
SlurmctldPort=6817
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool.%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
KillWait=10
MinJobAge=300
NodeName=n[1-3] NodeHostname={host} NodeAddr=127.0.0.1 Port=17001-17003 CPUs=2 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=n[1-3] Default=YES MaxTime=INFINITE State=UP
"""
NODES = ("n1", "n2", "n3")


def why_not() -> str | None:
    """Why a cluster cannot be started here (None: it can)."""
    found = {tool: shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "scontrol")}
    found["munged"] = shutil.which("munged") or (Path("/usr/sbin/munged").exists() or None)
    missing = [tool for tool, where in found.items() if not where]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing); .ci/run installs slurm-wlm and munge"
    if os.geteuid() != 0:
        return "starting slurmctld and slurmd needs root"
    if not Path("/etc/munge/munge.key").exists():
        return "munge has no key (/etc/munge/munge.key); the munge package creates it"
    return None


def _pid_files(root: Path) -> list[Path]:
    return [*(root / f"slurmd.{node}.pid" for node in NODES), root / "slurmctld.pid"]


def start(root: Path) -> None:
    for name in ("state", "log"):
        (root / name).mkdir(parents=True, exist_ok=True)
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged", "--force"], check=True)
    Path("/etc/slurm").mkdir(exist_ok=True)
    Path("/etc/slurm/slurm.conf").write_text(CONF.format(host=socket.gethostname(), root=root))
    subprocess.run(["slurmctld", "-c"], check=True)
    for node in NODES:
        subprocess.run(["slurmd", "-N", node], check=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        states = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True).stdout.split()
        if states and set(states) == {"idle"}:
            return
        time.sleep(0.25)
    raise RuntimeError(f"the test cluster did not come up: {(root / 'log' / 'slurmctld.log').read_text()[-2000:]}")


def stop(root: Path) -> None:
    for pid_file in _pid_files(root):
        if pid_file.is_file() and pid_file.read_text().strip():
            subprocess.run(["kill", pid_file.read_text().strip()], check=False)


def job_state(job_id: str) -> dict[str, str]:
    text = subprocess.run(["scontrol", "show", "job", job_id, "-o"], capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def wait_for_job(job_id: str, timeout_s: float) -> dict[str, str]:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        state = job_state(job_id)
        if state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(1)
    subprocess.run(["scancel", job_id], check=False)
    raise AssertionError(f"job {job_id} did not finish in {timeout_s} s: {job_state(job_id)}")
