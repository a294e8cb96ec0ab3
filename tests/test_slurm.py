"""The project's own sbatch scripts under real Slurm (a controller and three nodes on this host), with the tiny CPU
recipe swapped in: a 3-node job (one rank per node) runs to the end; a second one loses a node, continues on the
other two, is sent USR1 as before a time limit, saves, requeues itself and continues on three again. A fake
srun/scontrol test checks the argument forwarding of both scripts on any machine."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import slurm_cluster
from tests.conftest import REPO, TEST_BF16, free_port, train_losses

CPU_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {repo}/accelerate_configs/deepspeed/zero3.json
  zero3_init_flag: true
  deepspeed_multinode_launcher: standard
num_machines: {machines}
num_processes: {machines}
rdzv_backend: static
same_network: true
use_cpu: false
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = slurm_cluster.why_not()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    slurm_cluster.start(root)
    yield root
    slurm_cluster.stop(root)


def overrides(corpus, output_dir) -> list[str]:
    values = {
        "output_dir": output_dir, "tokenizer_name_or_path": corpus["tokenizer"], "train_files": corpus["train"],
        "validation_files": corpus["validation"], "eval_tasks": "[]", "bf16": str(TEST_BF16).lower(),
        "max_steps": 24, "save_steps": 8, "logging_steps": 1, "eval_steps": 100, "warmup_steps": 2,
        # a value with a space and braces: it reaches pretrain.py as one argument only through "$@"
        "lr_scheduler_kwargs": "{min_lr: 3e-4}",
    }  # fmt: skip
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def submit(script: str, machines: int, tmp_path, output_dir, corpus, extra=(), nodes=()) -> str:
    """`sbatch` the script with the tiny recipe and a CPU accelerate config of one process per node; `nodes`: sbatch's
    own node options (--nodes, --ntasks), which override the script's."""
    config = tmp_path / f"cpu_{machines}.yaml"
    config.write_text(CPU_CONFIG.format(repo=REPO, machines=machines))
    env_vars = {
        "ACCELERATE_CONFIG": str(config), "RECIPE": "recipes/configs/tiny_cpu.yaml", "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": str(REPO), "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        "MAIN_PROCESS_PORT": str(free_port()),
    }  # fmt: skip
    command = ["sbatch", "--parsable", *nodes, f"--chdir={REPO}", f"--output={tmp_path}/%x-%j.out", "--gpus-per-node=0",
               "--cpus-per-task=1", "--time=30", f"--export=ALL,{','.join(f'{k}={v}' for k, v in env_vars.items())}",
               f"scripts/slurm/{script}", *overrides(corpus, output_dir), *map(str, extra)]  # fmt: skip
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().split(";")[0]


def wait_until(condition, timeout_s: float, job: str, what: str, log=lambda: "") -> None:
    """Until `condition()`; fails when `timeout_s` passes or the job ends first, with the end of `log()`."""
    deadline = time.time() + timeout_s
    while not condition():
        state = slurm_cluster.job_state(job)
        # NODE_FAIL and COMPLETING pass on the way to a requeue; a job that stays there runs out of time below
        alive = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "NODE_FAIL", "REQUEUE_FED")
        assert time.time() < deadline and state.get("JobState") in alive, (
            f"waiting for {what}: {state}\n{log()[-8000:]}"
        )
        time.sleep(0.25)


@pytest.mark.slurm
@pytest.mark.multiprocess
def test_a_node_lost_mid_run_is_survived_unattended_and_the_run_grows_back(slurm, tmp_path, corpus):
    """The any-node script (elastic: true, preprocessed data) under real Slurm, asked for 2-3 nodes. First a job runs
    to the end on three nodes: the reference. Then a second job loses node n3 mid-run: Slurm requeues it, it continues
    on n1 and n2 (the checkpoint converted, accumulation 2 -> 3 for the 48-row global batch); n3 comes back, the job
    is sent USR1 as before a time limit, saves, requeues itself and continues on three. Every step is trained once, on
    the rows the reference trained, with the same global batch and the same losses up to summation order."""
    from data_prep.preprocessing.pipeline import preprocess
    from recipes.telemetry.metrics import read_metrics
    from recipes.training.checkpointing import read_manifest
    from tests.conftest import data_position

    packed = tmp_path / "packed"
    preprocess(str(corpus["tokenizer"]), [str(corpus["train"])], str(packed), 128, 2, rows_per_shard=500)
    # 48 rows: 3 processes x micro-batch 8 x accumulation 2, or 2 x 8 x 3
    # a hang (seen once, at the 2-node resume) ends in 2 minutes with every rank's stack in the log, which the
    # failure shows, rather than in the 10 minutes of waiting below
    extra = ["--train_files", packed, "--elastic", "true", "--save_steps", "4", "--global_batch_size", "48",
             "--hang_timeout_s", "120"]  # fmt: skip
    three_nodes = submit("llama70b.sbatch", 3, tmp_path, tmp_path / "three_nodes", corpus, extra,
                         nodes=["--nodes=3", "--ntasks=3"])  # fmt: skip
    state = slurm_cluster.wait_for_job(three_nodes, 900)
    log = next(tmp_path.glob(f"*-{three_nodes}.out")).read_text()
    assert state["JobState"] == "COMPLETED", log[-3000:]
    assert state["NodeList"] == "n[1-3]" and "on 3 processes / 3 node(s)" in log
    expected = train_losses(tmp_path / "three_nodes")
    assert sorted(expected) == list(range(1, 25))

    output_dir = tmp_path / "elastic"
    job = submit("llama70b.sbatch", 3, tmp_path, output_dir, corpus, extra, nodes=["--nodes=2-3", "--ntasks=3"])

    def text() -> str:
        path = next(tmp_path.glob(f"*-{job}.out"), None)
        return path.read_text() if path else ""

    wait_until(
        lambda: (output_dir / "checkpoint-4" / "manifest.json").exists(), 600, job, "checkpoint-4 on 3 nodes", text
    )
    assert slurm_cluster.job_state(job)["NodeList"] == "n[1-3]"
    lost_at = time.time()
    subprocess.run(["scontrol", "update", "nodename=n3", "state=down", "reason=test: node lost"], check=True)
    # and kept out: this cluster returns a DOWN node to service when its (live) slurmd registers again
    subprocess.run(["scontrol", "update", "nodename=n3", "state=drain", "reason=test: node lost"], check=True)
    wait_until(lambda: "world size 3 -> 2" in text() and "INFO pretrain: loss" in text().split("world size 3 -> 2")[-1],
               600, job, "training again on two nodes", text)  # fmt: skip
    training_again_s = time.time() - lost_at
    state = slurm_cluster.job_state(job)
    assert state["NodeList"] == "n[1-2]" and int(state["Restarts"]) == 1, (state, text()[-8000:])
    two_node_checkpoints = lambda: [c for c in output_dir.glob("checkpoint-*") if (c / "manifest.json").exists()  # noqa: E731
                                    and read_manifest(c)["world_size"] == 2]  # fmt: skip
    wait_until(two_node_checkpoints, 600, job, "a checkpoint saved on two nodes", text)
    subprocess.run(["scontrol", "update", "nodename=n3", "state=resume"], check=True)
    subprocess.run(["scancel", "-b", "--signal=USR1", job], check=True)  # the time limit's save-and-requeue, now
    state = slurm_cluster.wait_for_job(job, 900)
    log = text()
    print(f"node lost -> training again on two nodes: {training_again_s:.0f} s")
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "2", (state, log[-4000:])
    assert "time limit near: asking every rank to save" in log and "resume: continuing from" in log
    assert "world size 2 -> 3" in log and state["NodeList"] == "n[1-3]", log[-3000:]

    records = read_metrics(output_dir / "metrics.jsonl")
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 25)), "no global step repeated or skipped"
    changes = [(r["step"], r["previous_world_size"], r["world_size"], r["gradient_accumulation_steps"])
               for r in records if "previous_world_size" in r]  # fmt: skip
    assert [change[1:] for change in changes] == [(3, 2, 3), (2, 3, 2)], changes
    assert data_position(output_dir / "checkpoint-24")["global_rows_consumed"] == 24 * 48, "the same rows, once"
    # Until the first change the two jobs train alike (two identical jobs here have differed by 3e-7 at step 1); the
    # first step after each change matches to the docs' 1e-4 for a world-size change, and summation order drifts the
    # rest by a few 1e-5 (1.5e-4 at most seen)
    train, first_change = train_losses(output_dir), changes[0][0]
    after = [abs(train[s] / expected[s] - 1) for s in steps if s > first_change]
    print(f"relative loss difference after the first change: at most {max(after):.2g}")
    close = lambda step, rel: train[step] == pytest.approx(expected[step], rel=rel)  # noqa: E731
    assert all(close(s, 1e-5) for s in steps if s <= first_change), (train, expected)
    assert all(close(step + 1, 1e-4) for step, *_ in changes), (train, expected)
    assert all(close(s, 5e-4) for s in steps), (train, expected)
    assert "world size changes (global batch kept): step " in (output_dir / "report.md").read_text()


def fake_slurm(tmp_path: Path, python_body: str, **env: str) -> dict[str, str]:
    """The environment of a batch script run outside Slurm: srun, scontrol and python stand-ins on PATH (srun runs its
    command, scontrol knows one node n1 and records `requeue JOB` in tmp_path/requeued, python runs recipes.nodes and
    otherwise `python_body`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {
        "srun": f'#!/usr/bin/env bash\necho "$@" >> {tmp_path}/srun_args\n'
        '[[ -n "${FAKE_OVERLAP_FAILS:-}" && "$1" == --overlap ]] && exit 124\nwhile [[ "$1" == --* ]]; do shift; done\n'
        'SLURM_NODEID=0 SLURMD_NODENAME=${FAKE_NODENAME:-n1} exec "$@"\n',
        "scontrol": '#!/usr/bin/env bash\n'
        'if [ "$1 $2" = "show hostnames" ]; then printf "%s\\n" ${FAKE_HOSTNAMES:-n1}; '
        f'elif [ "$1" = requeue ]; then echo "$2" >> {tmp_path}/requeued; '
        'else echo "NodeName=n1 NodeAddr=10.1.2.3 State=IDLE"; fi\n',
        "python": f'#!/usr/bin/env bash\n[ "$2" = recipes.nodes ] && exec {sys.executable} "$@"\n{python_body}\n',
    }  # fmt: skip
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n1", **env}


def requeued(tmp_path: Path) -> list[str]:
    """The jobs the fake scontrol was asked to requeue."""
    return (tmp_path / "requeued").read_text().split() if (tmp_path / "requeued").exists() else []


def test_the_scripts_forward_every_argument_intact(tmp_path):
    """With a fake srun, scontrol and python on PATH: the overrides reach the launch word for word, through the
    wrapper that exits with the ranks' own code (recipes.launch)."""
    record_argv = (
        f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\" > {tmp_path}/argv.json"
    )
    env = fake_slurm(tmp_path, record_argv, SLURM_JOB_ID="7")
    one_node = REPO / "scripts/slurm/llama70b_1x8.sbatch"
    subprocess.run(["bash", str(one_node), "--note", "a  b"], cwd=REPO, env={**env, "SLURM_JOB_NUM_NODES": "1"},
                   check=True, timeout=60)  # fmt: skip
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[:2] == ["-m", "recipes.launch"]
    # mixed nodes: every node is asked for the fewest CPUs the job has on one (the batch host's 128 made n2 refuse)
    subprocess.run(["bash", str(one_node)], cwd=REPO, check=True, timeout=60,
                   env={**env, "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_CPUS_PER_NODE": "128(x2),96"})  # fmt: skip
    assert "--cpus-per-task=96 " in (tmp_path / "srun_args").read_text()
    assert argv[argv.index("--config") + 1] == "recipes/configs/llama70b_a800x8.yaml"
    assert argv[-2:] == ["--note", "a  b"]
    assert argv[argv.index("--num_processes") + 1] == "8" and argv[argv.index("--num_machines") + 1] == "1"
    script = REPO / "scripts/slurm/llama70b.sbatch"
    # any count Slurm gives it (by default the script asks for 1-2; --nodes=MIN-MAX on the command line)
    for nodes in (3, 2, 1):
        subprocess.run(["bash", str(script), "--lr_scheduler_kwargs", "{min_lr: 0}", "--note", "a  b"], cwd=REPO,
                       env={**env, "SLURM_JOB_NUM_NODES": str(nodes)}, check=True, timeout=60)  # fmt: skip
        argv = json.loads((tmp_path / "argv.json").read_text())
        assert argv[argv.index("--main_process_ip") + 1] == "10.1.2.3", "the head node's NodeAddr"
        assert argv[-4:] == ["--lr_scheduler_kwargs", "{min_lr: 0}", "--note", "a  b"]
        assert argv[argv.index("--config") + 1] == "recipes/configs/llama70b_a800x16.yaml"
        # 128 rows of micro-batch 2 train on 1, 2, 4 or 8 nodes: of 3 given, 2 train and one waits
        used = {3: 2}.get(nodes, nodes)
        assert argv[argv.index("--num_machines") + 1] == str(used)
        assert argv[argv.index("--num_processes") + 1] == str(8 * used), "8 processes on each node it uses"
    assert "#SBATCH --nodes=1-2" in script.read_text() and "#SBATCH --spread-job" in script.read_text()


def test_the_machine_rank_is_the_nodes_place_in_the_sorted_node_list(tmp_path):
    """SLURM_NODEID follows slurm.conf's order of nodes; the head is the first of the job's sorted node list. Where they
    differ, rank 0 started the rendezvous on a node that was not the head and no start ever formed. The rank is now the
    node's place in that list (a fake srun gives this task n2, with SLURM_NODEID 0)."""
    record_argv = (
        f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\" > {tmp_path}/argv.json"
    )
    env = fake_slurm(tmp_path, record_argv, SLURM_JOB_ID="2507", SLURM_RESTART_COUNT="1", SLURM_JOB_NUM_NODES="2",
                     FAKE_HOSTNAMES="n1 n2", FAKE_NODENAME="n2")  # fmt: skip
    env.pop("MAIN_PROCESS_PORT", None)
    subprocess.run(["bash", "scripts/slurm/llama70b.sbatch"], cwd=REPO, env=env, check=True, timeout=60)
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("--machine_rank") + 1] == "1" and argv[argv.index("--num_machines") + 1] == "2"
    assert argv[argv.index("--main_process_port") + 1] == str(20000 + 227 * 16 + 1), "job 2507's ports, second start"


@pytest.mark.parametrize(("code", "should_requeue"),
                         [(0, False), (1, True), (2, False), (3, False), (4, False), (5, True),
                          (137, True)])  # fmt: skip
def test_a_hang_or_a_stalled_data_source_is_requeued_and_a_bad_input_never_is(tmp_path, code, should_requeue):
    """Slurm's --requeue covers preemption and node failure, not exit codes: the docs promised a requeue after the hang
    watchdog's exit 1 that nothing did. The script requeues after 1 and 5 (at most PRETRAIN_FAILURE_REQUEUES times
    a job), never after 2-4, and exits with the ranks' code. 137: srun's code when one node's crash made it kill the
    others (stuck in a collective), which ended the job failed. With a fake srun, scontrol and python on PATH."""
    job = f"test{os.getpid()}{code}"
    env = fake_slurm(tmp_path, f"exit {code}", SLURM_JOB_ID=job, SLURM_JOB_NUM_NODES="1", PRETRAIN_FAILURE_REQUEUES="2")
    counter = REPO / "logs" / f".failure-requeues-{job}"
    try:
        runs = [subprocess.run(["bash", "scripts/slurm/llama70b_1x8.sbatch"], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=60) for _ in range(3)]  # fmt: skip
    finally:
        counter.unlink(missing_ok=True)
    assert [run.returncode for run in runs] == [code] * 3
    assert requeued(tmp_path) == ([job, job] if should_requeue else []), "after a hang or a stall, twice at most"
    if should_requeue:
        assert "failure 1 of 2" in runs[0].stdout and "failure 2 of 2" in runs[1].stdout
        assert f"not requeued: job {job} was requeued after 2 failure(s) already" in runs[2].stdout


def test_failures_are_counted_in_a_row_a_newer_checkpoint_starts_the_count_again(tmp_path):
    """A run of weeks ended at its fourth crash ever, however much it trained between them: the count of failures
    starts again when the run's `latest` checkpoint moved on since the failure before."""
    job = f"test{os.getpid()}progress"
    env = fake_slurm(tmp_path, "exit 1", SLURM_JOB_ID=job, SLURM_JOB_NUM_NODES="1", PRETRAIN_FAILURE_REQUEUES="2")
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    counter = REPO / "logs" / f".failure-requeues-{job}"
    runs = []
    try:
        for latest in ("checkpoint-100", "checkpoint-100", "checkpoint-300", "checkpoint-300", "checkpoint-300"):
            (output_dir / "latest").write_text(latest)
            runs.append(subprocess.run(["bash", "scripts/slurm/llama70b_1x8.sbatch", "--output_dir", str(output_dir)],
                                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60))  # fmt: skip
    finally:
        counter.unlink(missing_ok=True)
    assert requeued(tmp_path) == [job] * 4, [run.stdout for run in runs]
    assert "failure 2 of 2" in runs[1].stdout and "checkpoint-300 since the last failure" in runs[2].stdout
    assert "failure 1 of 2" in runs[2].stdout and "not requeued" in runs[4].stdout


def test_a_controller_that_fails_a_moment_does_not_end_the_job(tmp_path):
    """A controller failing over answers scontrol with an error for a moment: under `set -e` the batch shell ended
    there (the job with it, never requeued). Each scontrol call is retried for about a minute."""
    job = f"test{os.getpid()}flaky"
    env = fake_slurm(tmp_path, "exit 1", SLURM_JOB_ID=job, SLURM_JOB_NUM_NODES="1", PRETRAIN_SCONTROL_RETRY_S="0")
    real = tmp_path / "bin" / "scontrol"
    real.rename(tmp_path / "bin" / "scontrol-real")
    real.write_text(f'#!/usr/bin/env bash\ncalls=$(( $(cat {tmp_path}/calls 2>/dev/null || echo 0) + 1 ))\n'
                    f'echo $calls > {tmp_path}/calls\n(( calls % 3 == 0 )) || exit 1\n'
                    f'exec {tmp_path}/bin/scontrol-real "$@"\n')  # fmt: skip
    real.chmod(0o755)
    counter = REPO / "logs" / f".failure-requeues-{job}"
    try:
        run = subprocess.run(["bash", "scripts/slurm/llama70b_1x8.sbatch"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    finally:
        counter.unlink(missing_ok=True)
    assert run.returncode == 1 and requeued(tmp_path) == [job], run.stdout + run.stderr
    assert "scontrol show failed (attempt 2 of 6); retrying" in run.stderr


@pytest.mark.parametrize(("stopped", "for_good"), [(True, False), (False, False), (True, True)])
def test_ranks_that_saved_and_stopped_on_a_signal_are_requeued_and_a_finished_run_is_not(tmp_path, stopped, for_good):
    """A preemption with GraceTime signals the job's steps, not the batch shell, and Slurm requeues the job only if it
    is still running when the grace time ends: ranks that saved and exited 0 in time ended it COMPLETED, never to run
    again. Rank 0 says it stopped on a signal (recipes.launch.mark_stopped) and the script requeues the job, unless a
    person asked for a stop for good (logs/.stop-JOB, docs/slurm.md)."""
    job = f"test{os.getpid()}stopped{stopped}{for_good}"
    body = "exit 0"
    if stopped:
        body = f"{sys.executable} -c 'from recipes.launch import mark_stopped; mark_stopped()'; exit 0"
    if for_good:
        body = f"touch {REPO}/logs/.stop-{job}; {body}"
    env = fake_slurm(tmp_path, body, SLURM_JOB_ID=job, SLURM_JOB_NUM_NODES="1", PYTHONPATH=str(REPO))
    try:
        run = subprocess.run(["bash", "scripts/slurm/llama70b_1x8.sbatch"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    finally:
        (REPO / "logs" / f".stop-{job}").unlink(missing_ok=True)
    requeue = stopped and not for_good
    assert run.returncode == 0 and requeued(tmp_path) == ([job] if requeue else []), run.stdout + run.stderr
    assert not (REPO / "logs" / f".stopped-{job}").exists()
    assert not for_good or "not requeued: " in run.stdout


def usr1_once_started(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """The 1-node script run with fake Slurm, sent the time limit's USR1 once its training stand-in touched
    tmp_path/started; returns the ended script and its output."""
    script = subprocess.Popen(["bash", "scripts/slurm/llama70b_1x8.sbatch"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.time() + 30
    while not (tmp_path / "started").exists() and time.time() < deadline:
        time.sleep(0.05)
    script.send_signal(signal.SIGUSR1)
    out, _ = script.communicate(timeout=60)
    return script, out


def test_ranks_the_time_limits_signal_cannot_reach_in_time_are_requeued_at_once(tmp_path):
    """A controller slow to create the signalling step held the save past the time limit, and a TIMEOUT is never
    requeued: when srun cannot signal the ranks (timeout's 124 here), the job is requeued at once."""
    job = f"test{os.getpid()}slowstep"
    env = fake_slurm(tmp_path, f"touch {tmp_path}/started; sleep 3; exit 0", SLURM_JOB_ID=job,
                     SLURM_JOB_NUM_NODES="1", FAKE_OVERLAP_FAILS="1")  # fmt: skip
    script, out = usr1_once_started(tmp_path, env)
    assert "could not signal the ranks (srun: exit 124): requeueing job" in out and requeued(tmp_path) == [job], out


@pytest.mark.parametrize(("code", "should_requeue"), [(0, True), (2, False), (4, False)])
def test_the_time_limits_signal_requeues_a_saved_run_only(tmp_path, code, should_requeue):
    """USR1 ten minutes before the time limit: the script waits for the ranks and requeued the job whatever they
    exited with (a bad input found then came back every start). Now only a clean save (0) is requeued."""
    job = f"test{os.getpid()}usr1{code}"
    env = fake_slurm(tmp_path, f"touch {tmp_path}/started; sleep 3; exit {code}", SLURM_JOB_ID=job,
                     SLURM_JOB_NUM_NODES="1")  # fmt: skip
    script, out = usr1_once_started(tmp_path, env)
    assert script.returncode == code, "the job ends with the ranks' code (not wait's 138 for the signal)"
    assert "time limit near: asking every rank to save" in out
    assert requeued(tmp_path) == ([job] if should_requeue else []), out
    if not should_requeue:
        assert f"exit {code}: not requeued" in out


@pytest.mark.slurm
def test_preprocessing_as_a_job_array_merges_into_the_single_machine_corpus(slurm, tmp_path, corpus):
    from data_prep.parts.merge import merge
    from data_prep.preprocessing.pipeline import preprocess
    from data_prep.reading.readers import iter_texts

    texts = list(iter_texts(corpus["train"]))
    inputs = []
    for index in range(5):
        inputs.append(tmp_path / f"input-{index}.jsonl")
        inputs[-1].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[index::5]))
    env = f"ALL,PYTHONPATH={REPO},PATH={os.path.dirname(sys.executable)}:{os.environ['PATH']}"
    command = ["sbatch", "--parsable", "--array=0-2", f"--chdir={REPO}", f"--output={tmp_path}/%x-%A_%a.out",
               "--cpus-per-task=1", "--time=10", f"--export={env}", "scripts/slurm/preprocess_array.sbatch",
               str(tmp_path / "parts"), "--num-parts", "3", "--tokenizer", str(corpus["tokenizer"]), "--input",
               *map(str, inputs), "--seq-len", "64", "--rows-per-shard", "200"]  # fmt: skip
    job = subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().split(";")[0]
    for task in range(3):
        state = slurm_cluster.wait_for_job(f"{job}_{task}", 300)
        log = (tmp_path / f"preprocess-{job}_{task}.out").read_text()
        assert state["JobState"] == "COMPLETED", log[-3000:]
        assert f"part {task} of 3" in log
    merged = merge([str(tmp_path / "parts" / f"part-{task}") for task in range(3)], str(tmp_path / "merged"))
    single = preprocess(str(corpus["tokenizer"]), list(map(str, inputs)), str(tmp_path / "single"), 64, 2,
                        rows_per_shard=200)  # fmt: skip
    for key in ("num_documents", "num_document_tokens"):
        assert merged[key] == single[key], key
    assert all(part["num_documents"] > 0 for part in merged["merged_from"]), "each task made a part"


@pytest.mark.slurm
@pytest.mark.multiprocess
def test_cleaning_as_dependent_job_arrays_gives_the_local_result(slurm, tmp_path):
    """data_prep.clean --executor slurm: every stage a job array waiting on the one before (datatrove's Slurm
    executor), run on both nodes; a second submission is refused while the first's jobs live, and accepted once they
    are cancelled; the output and the report are those of a local run of the same command, and the same command
    afterwards has nothing to do."""
    from tests.test_clean import clean_command, output_lines, run_clean, write_cleaning_corpus

    corpus = write_cleaning_corpus(tmp_path / "raw", documents=45, copies=6)
    config = tmp_path / "clean.yaml"  # 4 buckets instead of 20: fewer jobs on a 4-CPU cluster, the same stages
    config.write_text("filters: {unknown_characters: {}, gopher_repetition: {}, gopher_quality: {}}\n"
                      "dedup: {num_buckets: 4, hashes_per_bucket: 5}\n")  # fmt: skip
    local = run_clean(corpus["files"], tmp_path / "local", "--config", str(config))
    assert local.returncode == 0, local.stderr[-3000:]
    command = clean_command(corpus["files"], tmp_path / "slurm", "--config", str(config), "--executor", "slurm",
                            "--partition", "debug", "--mem-per-cpu-gb", "1", "--time", "10")  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "submitted" in result.stdout, result.stdout + result.stderr[-3000:]
    jobs = [line.split("job ")[1] for line in result.stdout.splitlines() if ": " in line and "job " in line]
    assert len(jobs) == 6, result.stdout  # filter, signatures, buckets, clusters, dedup, finish
    second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2 and "is being cleaned by Slurm job(s)" in second.stderr, second.stderr
    # jobs queued by code that has changed since (docs/data-cleaning.md): cancelled, the same command submits again
    subprocess.run(["scancel", *jobs], check=True)
    deadline = time.time() + 60
    while subprocess.run(["squeue", "-h", "-j", ",".join(jobs)], capture_output=True, text=True).stdout.strip():
        assert time.time() < deadline, "the cancelled jobs did not leave the queue"
        time.sleep(0.5)
    resubmitted = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert resubmitted.returncode == 0 and "submitted" in resubmitted.stdout, resubmitted.stdout + resubmitted.stderr
    deadline = time.time() + 300
    while not (tmp_path / "slurm" / "clean_report.json").exists():
        logs = sorted((tmp_path / "slurm" / ".clean" / "stages").rglob("slurm_logs/*.out"))
        assert time.time() < deadline, "\n".join(log.read_text()[-1500:] for log in logs[-3:])
        time.sleep(1)
    assert output_lines(tmp_path / "slurm") == output_lines(tmp_path / "local")
    reports = [json.loads((tmp_path / name / "clean_report.json").read_text()) for name in ("local", "slurm")]
    assert reports[0]["steps"] == reports[1]["steps"] and reports[1]["steps"]["near_duplicates"]["docs_out"] < 51
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "already complete" in again.stdout, again.stdout + again.stderr
