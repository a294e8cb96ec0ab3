"""The project's own sbatch scripts under real Slurm (a controller and two nodes on this host), with the tiny CPU
recipe swapped in: a 2-node job (one rank per node) runs to the end; a 1-node job (two ranks) is sent USR1 as
before a time limit, saves, requeues itself, resumes from that checkpoint and ends with the same losses. A fake
srun/scontrol test checks the argument forwarding on any machine."""

import json
import os
import stat
import subprocess
import sys
import time

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
num_processes: 2
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


def submit(script: str, machines: int, tmp_path, output_dir, corpus) -> str:
    config = tmp_path / f"cpu_{machines}.yaml"
    config.write_text(CPU_CONFIG.format(repo=REPO, machines=machines))
    env_vars = {
        "ACCELERATE_CONFIG": str(config), "RECIPE": "recipes/configs/tiny_cpu.yaml", "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": str(REPO), "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        "MAIN_PROCESS_PORT": str(free_port()),
    }  # fmt: skip
    command = ["sbatch", "--parsable", f"--chdir={REPO}", f"--output={tmp_path}/%x-%j.out", "--gpus-per-node=0",
               "--cpus-per-task=2", "--time=30", f"--export=ALL,{','.join(f'{k}={v}' for k, v in env_vars.items())}",
               f"scripts/slurm/{script}", *overrides(corpus, output_dir)]  # fmt: skip
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().split(";")[0]


@pytest.mark.slurm
@pytest.mark.multiprocess
def test_sbatch_scripts_run_save_on_usr1_requeue_and_resume_on_real_slurm(slurm, tmp_path, corpus):
    two_nodes = submit("llama70b_2x8.sbatch", 2, tmp_path, tmp_path / "two_nodes", corpus)
    state = slurm_cluster.wait_for_job(two_nodes, 900)
    log = next(tmp_path.glob(f"*-{two_nodes}.out")).read_text()
    assert state["JobState"] == "COMPLETED", log[-3000:]
    assert state["NodeList"] == "n[1-2]" and "on 2 GPUs / 2 node(s)" in log
    expected = train_losses(tmp_path / "two_nodes")
    assert sorted(expected) == list(range(1, 25))

    one_node = submit("llama70b_1x8.sbatch", 1, tmp_path, tmp_path / "one_node", corpus)
    output_dir = tmp_path / "one_node"
    deadline = time.time() + 600
    while not (output_dir / "checkpoint-8").exists():
        assert time.time() < deadline and slurm_cluster.job_state(one_node)["JobState"] in ("PENDING", "RUNNING")
        time.sleep(0.5)
    # what --signal=B:USR1@600 does before the time limit, now: to the batch shell only
    subprocess.run(["scancel", "-b", "--signal=USR1", one_node], check=True)
    state = slurm_cluster.wait_for_job(one_node, 900)
    log = next(tmp_path.glob(f"*-{one_node}.out")).read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", log[-3000:]
    assert "time limit near: asking every rank to save" in log
    saved = json.loads((output_dir / "run_summary.json").read_text())["resumed_from"]
    assert saved and "resume: continuing from" in log
    assert train_losses(output_dir) == expected, "two ranks on one node, saved, requeued and resumed: the same losses"


def test_the_scripts_forward_every_argument_intact(tmp_path):
    """With a fake srun, scontrol and accelerate on PATH: the overrides reach the launch word for word."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {
        "srun": '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=0 exec "$@"\n',
        "scontrol": '#!/usr/bin/env bash\nif [ "$1 $2" = "show hostnames" ]; then echo n1; else echo "NodeName=n1 '
        'NodeAddr=10.1.2.3 State=IDLE"; fi\n',
        "accelerate": f'#!/usr/bin/env bash\n{sys.executable} -c \'import json, sys; print(json.dumps(sys.argv[1:]))\' '
        f'"$@" > {tmp_path}/argv.json\n',
    }  # fmt: skip
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "7"}
    script = REPO / "scripts/slurm/llama70b_2x8.sbatch"
    subprocess.run(["bash", str(script), "--lr_scheduler_kwargs", "{min_lr: 0}", "--note", "a  b"], cwd=REPO, env=env,
                   check=True, timeout=60)  # fmt: skip
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("--main_process_ip") + 1] == "10.1.2.3", "the head node's NodeAddr"
    assert argv[-4:] == ["--lr_scheduler_kwargs", "{min_lr: 0}", "--note", "a  b"]
    assert argv[argv.index("--config") + 1] == "recipes/configs/llama70b_a800x16.yaml"


@pytest.mark.slurm
def test_preprocessing_as_a_job_array_merges_into_the_single_machine_corpus(slurm, tmp_path, corpus):
    from data_prep.merge import merge
    from data_prep.preprocess import preprocess
    from data_prep.readers import iter_texts

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
