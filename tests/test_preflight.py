"""Refusals that preflight makes before the model is built, checked here by calling the check itself: a launch would
only add ~20 s of process start to the same answer. tests/test_run_safety.py keeps launches that show such a
refusal reaching the user as one line, with nothing built."""

import json
import socket
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from recipes.config import ConfigError, load_config
from tests.conftest import REPO, TINY_RECIPE, tiny_overrides


def test_a_busy_metrics_port_is_refused_before_the_model_is_built():
    """Preflight's check (on every node's local rank 0, before the model; no launch needed to see its answer)."""
    from recipes.training.startup import check_port_free

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"prometheus_port {port} cannot be served on {socket.gethostname()}"):
            check_port_free(port)
    check_port_free(port)


def test_a_preprocessed_directory_without_a_global_batch_is_refused(tmp_path, corpus):
    """Refused when the training data is opened, before the model (no launch needed to see the answer)."""

    from data_prep.preprocessing.pipeline import preprocess
    from recipes.config import ConfigError
    from recipes.training.train_data import TrainData, open_train_source

    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "def f(): return 1"}) + "\n")
    packed = tmp_path / "packed"
    assert preprocess(str(corpus["tokenizer"]), [str(tiny)], str(packed), 128, 1)["num_sequences"] == 0
    config = load_config(
        REPO / "recipes/configs/tiny_cpu.yaml", tiny_overrides(corpus, tmp_path / "run", train_files=packed)[2:]
    )
    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    with pytest.raises(ConfigError, match="0 preprocessed rows are fewer than one global batch of 32"):
        TrainData(open_train_source(config, tokenizer, 2), config, tokenizer, rank=0, world=2)


def test_a_launch_for_more_gpus_than_the_node_has_stops_naming_both_numbers(monkeypatch):
    """Checked first thing in every rank (no launch needed to see the answer)."""
    import torch

    from recipes.training.startup import check_gpus_per_node

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs the launch asks for")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    with pytest.raises(
        ConfigError, match=f"starts 2 processes on this node, but it has {torch.cuda.device_count()} GPU"
    ):
        check_gpus_per_node()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    check_gpus_per_node()  # a deliberate CPU rehearsal


def preflight_refusal(corpus, output_dir, **overrides) -> str:
    """What preflight (recipes.training.startup.preflight, run by every rank of a launch before the model) says of the
    tiny recipe with `overrides` on a 2-process launch, or "" when it accepts it."""
    from types import SimpleNamespace

    from recipes.config.deepspeed import load_deepspeed_json, resolve_deepspeed_config
    from recipes.training.startup import preflight

    config = load_config(TINY_RECIPE, tiny_overrides(corpus, output_dir, **overrides)[2:])
    ds_config = resolve_deepspeed_config(
        load_deepspeed_json(REPO / "accelerate_configs/deepspeed/zero3.json"), config, world_size=2
    )
    accelerator = SimpleNamespace(num_processes=2, process_index=0, is_main_process=True, is_local_main_process=True,
                                  device="cpu")  # fmt: skip
    try:
        preflight(config, accelerator, ds_config)
    except (ConfigError, ValueError) as error:
        return str(error)
    return ""


def test_an_impossible_global_batch_is_refused_naming_the_launch_that_would_fit(corpus, tmp_path):
    from recipes.config import validate_for_world

    config = load_config(TINY_RECIPE, tiny_overrides(corpus, tmp_path, global_batch_size=64)[2:])
    with pytest.raises(ConfigError, match="global_batch_size is 64.*Launch on 4 processes"):
        validate_for_world(config, 2)


def test_elastic_on_raw_text_is_refused_before_a_node_is_ever_lost(corpus, tmp_path):
    """A raw-text position is per rank: an elastic run on it would learn so only at its first change of world size."""
    said = preflight_refusal(corpus, tmp_path / "out", elastic="true")
    assert said.startswith("elastic: true needs preprocessed train data"), said


def test_a_run_that_does_not_fit_is_refused_by_the_plan(corpus, tmp_path):
    # Without CUDA the recipe's hardware.gpu_memory_gb stands in for device memory.
    said = preflight_refusal(corpus, tmp_path, **{"hardware.gpu_memory_gb": 0.5})
    assert "the plan says this run does not fit" in said and "0.5 GB available" in said
    assert preflight_refusal(corpus, tmp_path) == ""


def test_a_missing_benchmark_directory_is_refused(corpus, tmp_path):
    said = preflight_refusal(corpus, tmp_path / "out", eval_tasks="[mmlu]", mmlu_dir=tmp_path / "no_mmlu")
    assert f"mmlu_dir {tmp_path / 'no_mmlu'} does not exist" in said


def test_a_few_shot_count_larger_than_the_few_shot_split_is_refused(corpus, tmp_path):
    """Once every in-loop evaluation failed ("Sample larger than population") and the run ended 0 with no scores."""
    from eval import fixtures

    data = fixtures.write(tmp_path / "eval_data")
    said = preflight_refusal(corpus, tmp_path / "out", eval_tasks="[mmlu]", mmlu_dir=data["mmlu_csv"],
                             eval_num_fewshot=6)  # fmt: skip
    assert said.startswith("eval_num_fewshot 6: MMLU's dev split has 5 rows for "), said
    said = preflight_refusal(corpus, tmp_path / "out", eval_tasks="[gsm8k]", gsm8k_dir=data["gsm8k_jsonl"],
                             per_device_eval_batch_size=1, eval_max_gen_toks=0)  # fmt: skip
    assert said == "eval_max_gen_toks 0: must be at least 1 or unset"


def test_a_benchmark_task_with_fewer_documents_than_ranks_is_accepted(corpus, tmp_path):
    """Refused for a while (over 2 ranks, a subject of one document hung); now scored: tests/test_eval_sharded.py."""
    from eval import fixtures

    data = fixtures.write(tmp_path / "eval_data", test_per_subject=1, gsm8k_test=1)
    assert preflight_refusal(corpus, tmp_path / "out", eval_tasks="[mmlu, gsm8k]", mmlu_dir=data["mmlu_csv"],
                             gsm8k_dir=data["gsm8k_jsonl"], eval_limit=1) == ""  # fmt: skip


def test_a_validation_set_that_yields_no_row_is_refused_before_the_model(corpus, tmp_path):
    """It used to be read after the model was built, and ended in a traceback with exit 1 (a requeue, forever)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    said = preflight_refusal(corpus, tmp_path / "out", validation_files=empty)
    assert said.startswith(f"validation_files ['{empty}'] yield no full row of 128 tokens"), said
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "a few words"}\n')
    assert "yield no full row" in preflight_refusal(corpus, tmp_path / "out", validation_files=short)


def test_an_output_dir_that_cannot_be_written_is_refused_in_one_line(corpus, tmp_path, monkeypatch):
    """It used to end in a PermissionError traceback with exit 1, which a scheduler following the docs requeues."""
    import errno
    import os
    from pathlib import Path

    from recipes.training import output_dir

    def refusal(target) -> str:
        config = load_config(TINY_RECIPE, tiny_overrides(corpus, target)[2:])
        with pytest.raises(ConfigError) as refused:
            output_dir.lock(config)
        return str(refused.value)

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert refusal(blocker / "run").startswith(f"output_dir {blocker / 'run'}: cannot write ")
    assert "(File exists); choose a directory this user can create and write" in refusal(blocker)
    if os.geteuid() != 0:
        (tmp_path / "ro").mkdir(mode=0o500)
        assert "(Permission denied)" in refusal(tmp_path / "ro" / "run")
    else:  # root writes anywhere: the file system's refusal is made here, as a read-only mount would make it

        def read_only(self, *args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

        monkeypatch.setattr(Path, "mkdir", read_only)
        assert f"cannot write {tmp_path / 'ro'} (Read-only file system)" in refusal(tmp_path / "ro")
    assert blocker.read_text() == ""


def test_a_directory_made_for_another_row_length_is_refused(corpus, tmp_path):
    from data_prep.preprocessing.pipeline import preprocess

    packed = tmp_path / "packed"
    preprocess(str(corpus["tokenizer"]), [str(corpus["validation"])], str(packed), 128, 1)
    said = preflight_refusal(corpus, tmp_path / "out", train_files=packed, max_seq_length=64)
    assert "holds rows of 128 tokens, max_seq_length is 64" in said


def test_overwrite_output_dir_never_deletes_what_the_new_run_reads(corpus, tmp_path):
    """A run continued from the old run's final/ with overwrite_output_dir: true used to delete that model before
    loading it. The directories named like the run's outputs are removed only when nothing read lies in them."""
    from recipes.training.output_dir import check_fresh_start

    run = tmp_path / "run"
    for name in ("checkpoint-4", "final", "eval"):
        (run / name).mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    (run / "eval" / "mmlu").mkdir()
    overwrite = {"overwrite_output_dir": "true", "resume_from_checkpoint": "none"}
    cases = [(run / "final", "model_name_or_path", "final"), (run / "eval" / "mmlu", "mmlu_dir", "eval"),
             (f"{run}/final/*.jsonl", "train_files", "final")]  # fmt: skip
    for reads, key, doomed in cases:
        shape = {"model_config": "{}"} if key == "model_name_or_path" else {}
        config = load_config(TINY_RECIPE, tiny_overrides(corpus, run, **overwrite, **shape, **{key: reads})[2:])
        with pytest.raises(ConfigError, match=f"would delete {run / doomed}, which {key} reads"):
            check_fresh_start(config)
        assert sorted(p.name for p in run.iterdir()) == ["checkpoint-4", "eval", "final"]
    check_fresh_start(load_config(TINY_RECIPE, tiny_overrides(corpus, run, **overwrite)[2:]))
    assert list(run.iterdir()) == [], "the old run's outputs go when nothing read lies in them"


def test_trackers_that_would_fail_after_the_model_are_refused_before_it(tmp_path, monkeypatch):
    from recipes.telemetry.trackers import check_trackers

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    with pytest.raises(ConfigError, match=r"report_to wandb: no W&B API key .*WANDB_MODE=offline"):
        check_trackers(["tensorboard", "wandb"], {})
    check_trackers(["wandb"], {"WANDB_MODE": "offline"})
    with socket.socket() as closed:  # a port nothing listens on: the connection is refused at once
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with pytest.raises(ConfigError, match=r"report_to wandb: http://127\.0\.0\.1:\d+ cannot be reached .*offline"):
        check_trackers(["wandb"], {"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": url})
    with pytest.raises(ConfigError, match=r"report_to mlflow: MLFLOW_TRACKING_URI .* cannot be reached"):
        check_trackers(["mlflow"], {"MLFLOW_TRACKING_URI": url})
    check_trackers(["mlflow"], {})  # a local file store needs nothing


def test_wandb_keeps_its_own_directory_when_one_is_set(tmp_path, monkeypatch):
    import accelerate.tracking

    from recipes.telemetry.trackers import trackers_for

    made = []
    monkeypatch.setattr(accelerate.tracking, "WandBTracker", lambda *args, **kwargs: made.append(kwargs))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_here"))
    trackers_for(["wandb"], tmp_path / "run")
    monkeypatch.delenv("WANDB_DIR")
    trackers_for(["wandb"], tmp_path / "run")
    assert [kwargs["dir"] for kwargs in made] == [str(tmp_path / "wandb_here"), str(tmp_path / "run")]


def test_the_metrics_endpoint_listens_on_this_host_only_unless_told():
    from recipes.telemetry.monitoring import PrometheusExporter

    exporter = PrometheusExporter(0)
    try:
        assert exporter._server.server_address[0] == "127.0.0.1"
    finally:
        exporter._server.shutdown()
    assert load_config(TINY_RECIPE, ["--metrics_host", "0.0.0.0"]).metrics_host == "0.0.0.0"
    script = (REPO / "scripts/slurm/run.sh").read_text()
    assert "--metrics_host 0.0.0.0" in script, "the Slurm scripts serve it to a Prometheus on another machine"


def test_a_leaf_class_the_model_does_not_have_is_refused_naming_the_classes_it_has(corpus, tmp_path):
    """DeepSpeed itself would say so only when the engine is built, and only if no name matched at all."""
    said = preflight_refusal(corpus, tmp_path / "out", zero3_leaf_modules="[LlamaDecoderLayer,MixtralSparseMoeBlock]")
    assert said.startswith("zero3_leaf_modules: ['MixtralSparseMoeBlock'] match no module of this model"), said
    assert "LlamaDecoderLayer" in said and "[] hooks every module" in said
    assert preflight_refusal(corpus, tmp_path / "out2", zero3_leaf_modules="[]") == ""


def test_a_running_runs_tokenizer_cannot_be_trained_over(corpus, tmp_path, capsys):
    """`train_tokenizer --overwrite` into a live run's tokenizer directory replaced it, rc 0 (issue 37): preflight pins
    the directory (a shared flock beside it, held while the run lives) and --overwrite refuses a pinned one."""
    import shutil

    from common.lock import held_by_someone
    from data_prep.tokenizer.loading import tokenizer_pin
    from data_prep.tokenizer.training import main as train_tokenizer
    from recipes.config.deepspeed import load_deepspeed_json, resolve_deepspeed_config
    from recipes.training.startup import preflight

    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(corpus["tokenizer"], tokenizer)
    config = load_config(TINY_RECIPE, tiny_overrides(corpus, tmp_path / "out", tokenizer_name_or_path=tokenizer)[2:])
    ds_config = resolve_deepspeed_config(load_deepspeed_json(REPO / "accelerate_configs/deepspeed/zero3.json"),
                                         config, world_size=2)  # fmt: skip
    from types import SimpleNamespace

    accelerator = SimpleNamespace(num_processes=2, process_index=0, is_main_process=True, is_local_main_process=True,
                                  device="cpu")  # fmt: skip
    inputs = preflight(config, accelerator, ds_config)
    assert held_by_someone(tokenizer_pin(tokenizer))
    again = ["--input", str(corpus["train"]), "--vocab-size", "512", "--output", str(tokenizer), "--overwrite"]
    with pytest.raises(SystemExit) as refused:
        train_tokenizer(again)
    assert refused.value.code == 2
    assert "is the tokenizer of a training run that is running now" in capsys.readouterr().err
    inputs.tokenizer_pin.release()  # the run ends
    assert not tokenizer_pin(tokenizer).exists()
    train_tokenizer([*again[:3], "300", *again[4:]])


def _ranks_that_read_different_files(rank, outcome_dir):
    """Rank 1 read a validation file of its node that differs in one token; its node also has less memory."""
    import torch

    from common.collectives import smallest_on_any_rank
    from recipes.config import ConfigError
    from recipes.training.startup import check_ranks_read_alike

    rows = torch.arange(12).reshape(3, 4)
    check_ranks_read_alike({"tokenizer": "t"}, rows, "sdpa")  # alike: nothing said
    if rank == 1:
        rows[2, 3] = 99
    try:
        check_ranks_read_alike({"tokenizer": "t"}, rows, "sdpa")
    except ConfigError as error:
        (Path(outcome_dir) / f"rank-{rank}.txt").write_text(str(error))
    (Path(outcome_dir) / f"batch-{rank}.txt").write_text(str(smallest_on_any_rank(23 if rank else 32)))


@pytest.mark.multiprocess
def test_ranks_that_read_different_inputs_are_refused_on_every_rank_and_take_the_smallest_eval_batch(tmp_path):
    """Each rank reads the tokenizer, data and validation files from its own node: a node-local copy that differed
    gave its ranks another number of validation batches (a hang at the first evaluation) or other training rows. Every
    rank now compares with rank 0 before the model and all refuse together, naming the ranks and hosts; the
    evaluation batch is the smallest any node fits (nodes of unlike memory)."""
    from gloo_ranks import on_ranks

    on_ranks(_ranks_that_read_different_files, 2, tmp_path, str(tmp_path), timeout_s=30)
    said = [(tmp_path / f"rank-{rank}.txt").read_text() for rank in (0, 1)]
    assert said[0] == said[1] and said[0].startswith("the ranks read different inputs")
    assert "validation rows (sha256): rank 0 (" in said[0] and "rank(s) [1]" in said[0] and "identity" not in said[0]
    assert [(tmp_path / f"batch-{rank}.txt").read_text() for rank in (0, 1)] == ["23", "23"]
