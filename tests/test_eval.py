"""Benchmarks through lm-eval on fixture files written here: both offline layouts of MMLU and GSM8K,
lm-eval's own prompts, the standalone runner, and the in-loop hook's RNG and mode hygiene."""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from data_prep.benchmark_files.layouts import BenchmarkDataError, check_gsm8k, check_mmlu, load_gsm8k, load_mmlu_subject
from eval import fixtures
from eval.harness import MMLU_SUBJECTS, BenchmarkSettings, evaluate, task_manager
from eval.in_loop import capture_rng_state, run_benchmarks
from eval.run import main as run_main


@pytest.fixture(autouse=True)
def online(monkeypatch):
    """The checks refuse hub tasks offline; data_prep's cleaning CLI sets HF_HUB_OFFLINE when a test runs its main, for
    the rest of the test process. Tests that ask for offline set it themselves."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return fixtures.write(tmp_path_factory.mktemp("eval_data"))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, corpus):
    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    directory = tmp_path_factory.mktemp("model")
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_both_layouts_load_the_same_documents(data):
    assert check_mmlu(data["mmlu_csv"]) == check_mmlu(data["mmlu_parquet"]) == list(fixtures.SUBJECTS)
    for subject in fixtures.SUBJECTS:
        csv_docs = load_mmlu_subject(data["mmlu_csv"], subject)
        assert csv_docs == load_mmlu_subject(data["mmlu_parquet"], subject)
        first = csv_docs["test"][0]
        assert set(first) == {"question", "subject", "choices", "answer"} and len(first["choices"]) == 4
        assert len(csv_docs["dev"]) == 5
    assert load_gsm8k(data["gsm8k_jsonl"]) == load_gsm8k(data["gsm8k_parquet"])
    assert check_gsm8k(data["gsm8k_jsonl"]) == 8


SECRET = "What is the airspeed velocity of an unladen swallow"


@pytest.mark.parametrize(("answer", "why"), [("", "blank"), ("CD", "2 characters"), ("E", "not A-D"), ("a", "not A-D")])
def test_an_mmlu_answer_must_be_exactly_one_letter(tmp_path, answer, why):
    """`fields[5].strip() not in "ABCD"` was a substring test: a blank answer loaded as A and CD as C."""
    for split in ("test", "dev"):
        (tmp_path / split).mkdir()
        (tmp_path / split / f"anatomy_{split}.csv").write_text(f'"{SECRET}",a,b,c,d,B\n"{SECRET}",a,b,c,d,{answer}\n')
    with pytest.raises(BenchmarkDataError) as error:
        check_mmlu(tmp_path)
    assert "anatomy_test.csv:2: the answer must be one letter" in str(error.value) and why in str(error.value)
    assert SECRET not in str(error.value), "benchmark questions stay out of logs"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('["a", "list"]', "expected a JSON object, found a JSON list"),
        ('{"question": "q"}', "ending in '#### N'"),
        ('{"question": "q", "answer": "#### many"}', "ending in '#### N'"),
        ('{"answer": "x #### 4"}', "'question'"),
    ],
)
def test_every_gsm8k_line_is_an_object_with_a_question_and_a_numeric_answer(tmp_path, line, expected):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": SECRET, "answer": "so #### 4"}) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": SECRET, "answer": "so #### 4"}) + "\n" + line + "\n")
    with pytest.raises(BenchmarkDataError, match=r"test.jsonl:2: ") as error:
        check_gsm8k(tmp_path)
    assert expected in str(error.value) and SECRET not in str(error.value)


def test_an_empty_gsm8k_test_file_or_empty_few_shot_split_is_named(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "so #### 4"}) + "\n")
    (tmp_path / "test.jsonl").write_text("")
    with pytest.raises(BenchmarkDataError, match=r"test.jsonl holds no problems"):
        check_gsm8k(tmp_path)
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "so #### 4"}) + "\n")
    (tmp_path / "train.jsonl").write_text("\n")
    with pytest.raises(BenchmarkDataError, match=r"train.jsonl holds no problems"):
        check_gsm8k(tmp_path)


def test_a_hub_mmlu_answer_must_be_an_index_0_to_3(tmp_path):
    subject = tmp_path / "anatomy"
    subject.mkdir()
    good = {"question": [SECRET], "subject": ["anatomy"], "choices": [["a", "b", "c", "d"]], "answer": [1]}
    pq.write_table(pa.table(good), subject / "dev-0.parquet")
    pq.write_table(pa.table({**good, "answer": [4]}), subject / "test-0.parquet")
    with pytest.raises(BenchmarkDataError, match=r"test-0.parquet: row 0: answer must be an integer 0-3") as error:
        check_mmlu(tmp_path)
    assert SECRET not in str(error.value)


def test_missing_or_malformed_data_names_what_was_expected(tmp_path, data):
    with pytest.raises(BenchmarkDataError, match=r"does not exist"):
        check_mmlu(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BenchmarkDataError, match=r"test/<subject>_test.csv .*<subject>/test-\*.parquet"):
        check_mmlu(tmp_path / "empty")
    with pytest.raises(BenchmarkDataError, match=r"test.jsonl and train.jsonl\) or an openai/gsm8k snapshot"):
        check_gsm8k(tmp_path / "empty")
    bad = tmp_path / "mmlu" / "test"
    bad.mkdir(parents=True)
    (bad / "anatomy_test.csv").write_text('"q",a,b,c,d,A\n"q2",a,b,c,d,E\n')
    with pytest.raises(BenchmarkDataError, match=r"anatomy_test.csv:2: the answer must be one letter A, B, C or D"):
        check_mmlu(tmp_path / "mmlu")
    (bad / "anatomy_test.csv").write_text('"q",a,b,c,d,A\n')
    with pytest.raises(BenchmarkDataError, match=r"dev/anatomy_dev.csv is missing"):
        check_mmlu(tmp_path / "mmlu")
    gsm = tmp_path / "gsm"
    gsm.mkdir()
    (gsm / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(BenchmarkDataError, match=r"test.jsonl:1: expected an 'answer' string ending in '#### N'"):
        check_gsm8k(gsm)
    (tmp_path / "hub" / "anatomy").mkdir(parents=True)
    pq.write_table(pa.table({"question": ["q"]}), tmp_path / "hub" / "anatomy" / "test-0.parquet")
    with pytest.raises(BenchmarkDataError, match=r"columns \['subject', 'choices', 'answer'\] missing"):
        check_mmlu(tmp_path / "hub")
    with pytest.raises(ValueError, match=r"--tasks: \['hellaswag'\] unknown"):
        BenchmarkSettings(tasks=["hellaswag"]).check()
    with pytest.raises(ValueError, match=r"eval_tasks: \['hellaswag'\] unknown"):
        BenchmarkSettings(tasks=["hellaswag"]).check({"tasks": "eval_tasks"})


def test_an_mmlu_directory_without_mmlus_subject_names_is_refused_and_one_with_some_is_named(data, tmp_path):
    """A cais/mmlu snapshot of its `all` folder only loaded and passed every check, and then MMLU did not run at all
    (no subject by name: `mmlu/acc` never logged, no word); with `--tasks mmlu` alone, lm-eval's "No tasks specified"
    came after the model had loaded. Refused now before any model. A copy with some subjects runs them, and says so."""
    import shutil

    from eval.harness import MMLU_SUBJECTS

    every = pq.read_table(next((Path(data["mmlu_parquet"]) / "elementary_mathematics").glob("test-*.parquet")))
    snapshot = tmp_path / "mmlu_all_only"
    for folder in ("all", "auxiliary_train"):
        (snapshot / folder).mkdir(parents=True)
        for split in ("test", "dev"):
            pq.write_table(every, snapshot / folder / f"{split}-00000-of-00001.parquet")
    for tasks in (["mmlu", "gsm8k"], ["mmlu"]):
        with pytest.raises(ValueError) as refused:
            BenchmarkSettings(tasks, str(snapshot), str(data["gsm8k_jsonl"])).check({"mmlu_dir": "mmlu_dir"})
        said = str(refused.value)
        assert said.startswith(f"mmlu_dir {snapshot}: no MMLU subject by name (found: all, auxiliary_train)"), said
        assert "\n" not in said and "per-subject folders" in said
    shutil.copytree(Path(data["mmlu_parquet"]) / "elementary_mathematics", snapshot / "elementary_mathematics")
    warnings = BenchmarkSettings(["mmlu"], str(snapshot)).check()
    assert warnings == [f"--mmlu-dir {snapshot} holds 1 of the {len(MMLU_SUBJECTS)} MMLU subjects (missing: "
                        "abstract_algebra, anatomy, astronomy, business_ethics, clinical_knowledge, ...): mmlu/acc is "
                        "their accuracy weighted by size, not MMLU's"]  # fmt: skip


def test_an_answer_budget_without_room_for_a_prompt_is_refused(tmp_path, data, tiny_model_dir, capsys):
    """`--max-gen-toks` at or above the model's positions: lm-eval asserted it only at GSM8K's first generation, after
    the whole of MMLU (hours at 70B), and the recipe failed every evaluation. Refused with one line before any model."""
    import json

    with pytest.raises(ValueError, match=r"eval_max_gen_toks 64: the model has 64 positions"):
        BenchmarkSettings(["gsm8k"], max_gen_toks=64).check({"max_gen_toks": "eval_max_gen_toks"}, positions=64)
    with pytest.raises(ValueError, match=r"--max-gen-toks 256 \(lm-eval's default\): the model has 128 positions"):
        BenchmarkSettings(["gsm8k"]).check(positions=128)
    BenchmarkSettings(["mmlu"], max_gen_toks=64).check(positions=64)  # no generation
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    code = run_main(["--model", str(model), "--tasks", "gsm8k", "--gsm8k-dir", str(data["gsm8k_jsonl"]),
                     "--max-gen-toks", "32", "--output", str(tmp_path / "r.json")])  # fmt: skip
    said = capsys.readouterr().err
    assert code == 2 and said.count("\n") == 1 and "--max-gen-toks 32: the model has 32 positions" in said, said


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        (
            {"tasks": ["mmlu"], "num_fewshot": 6},
            "--num-fewshot 6: MMLU's dev split has 5 rows for elementary_mathematics, so at most 5 examples",
        ),
        (
            {"tasks": ["gsm8k"], "num_fewshot": 11},
            "--num-fewshot 11: GSM8K's train split (its few-shot examples) has 10 rows, so at most 10",
        ),
        ({"tasks": ["mmlu"], "num_fewshot": 6, "mmlu_dir": None}, "MMLU's dev split has 5 rows for every subject"),
        ({"tasks": ["gsm8k"], "num_fewshot": -1}, "--num-fewshot -1: must be at least 0"),
        ({"tasks": ["gsm8k"], "limit": 0}, "--limit 0: must be at least 1 or unset"),
        ({"tasks": ["gsm8k"], "batch_size": 0}, "--batch-size 0: must be at least 1"),
        ({"tasks": ["gsm8k"], "max_gen_toks": 0}, "--max-gen-toks 0: must be at least 1 or unset"),
    ],
)
def test_settings_that_cannot_work_are_refused_before_any_model(data, settings, said):
    """MMLU's dev split holds exactly 5 rows per subject: a 6-shot run once failed every evaluation with lm-eval's
    "Sample larger than population" and finished with no scores; --limit 0 failed late, --batch-size 0 passed."""
    values = {"mmlu_dir": data["mmlu_csv"], "gsm8k_dir": data["gsm8k_jsonl"], **settings}
    with pytest.raises(ValueError) as refused:
        BenchmarkSettings(**values).check()
    assert said in str(refused.value)
    BenchmarkSettings(**{**values, "num_fewshot": 5, "limit": 1, "batch_size": 1, "max_gen_toks": None}).check()


def test_local_tasks_are_lm_evals_own_prompts_and_metrics(data):
    import lm_eval.tasks
    import yaml

    settings = BenchmarkSettings(["mmlu", "gsm8k"], str(data["mmlu_csv"]), str(data["gsm8k_jsonl"]))
    manager = task_manager(tuple(sorted(settings.metadata().items())), False)
    loaded = manager.load(["mmlu_local_elementary_mathematics", "gsm8k_local"])["tasks"]
    subject_task, gsm8k = loaded["mmlu_local_elementary_mathematics"], loaded["gsm8k_local"]
    root = Path(lm_eval.tasks.__file__).parent
    template = yaml.safe_load((root / "mmlu/default/_default_template_yaml").read_text())
    assert subject_task.config.doc_to_text == template["doc_to_text"]
    assert subject_task.config.fewshot_split == "dev" and subject_task.config.test_split == "test"
    assert subject_task.config.fewshot_config.sampler == template["fewshot_config"]["sampler"] == "first_n"
    doc = subject_task.test_docs()[0]
    letters = "\n".join(f"{letter}. {choice}" for letter, choice in zip("ABCD", doc["choices"], strict=True))
    assert subject_task.doc_to_text(doc) == f"{doc['question'].strip()}\n{letters}\nAnswer:"
    assert subject_task.doc_to_target(doc) == doc["answer"]
    stock_subject = yaml.safe_load((root / "mmlu/default/mmlu_elementary_mathematics.yaml").read_text())
    assert subject_task.config.description == stock_subject["description"]
    stock = yaml.safe_load((root / "gsm8k/gsm8k.yaml").read_text())
    for key in ("doc_to_text", "fewshot_split", "generation_kwargs", "filter_list", "num_fewshot"):
        assert getattr(gsm8k.config, key) == stock[key], key
    assert len(MMLU_SUBJECTS) == 57


def test_lm_evals_cli_and_eval_run_give_identical_scores(tmp_path, data, tiny_model_dir):
    """The shipped task YAMLs through the standard `lm_eval` command as docs/benchmarks.md writes it (no few-shot
    flag: the tasks are 5-shot, as eval.run's default) and through eval.run: the same numbers."""
    import subprocess
    import sys

    metadata = json.dumps({"mmlu_dir": str(data["mmlu_csv"]), "gsm8k_dir": str(data["gsm8k_jsonl"])})
    tasks = ",".join([*(f"mmlu_local_{s}" for s in fixtures.SUBJECTS), "gsm8k_local"])
    model_args = f"pretrained={tiny_model_dir},dtype=float32,add_bos_token=False"
    cli = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", model_args,
           "--include_path", str(Path("eval/tasks").resolve()), "--tasks", tasks, "--metadata", metadata,
           "--limit", "3", "--batch_size", "8", "--device", "cpu",
           "--gen_kwargs", "max_gen_toks=16", "--output_path", str(tmp_path / "cli")]  # fmt: skip
    documented = (Path(__file__).parent.parent / "docs/benchmarks.md").read_text()
    assert "--tasks mmlu_local,gsm8k_local --output_path " in documented, "the documented line saves its results"
    assert "parallelize=True,add_bos_token=False" in documented, "no BOS, as eval.run and training"
    completed = subprocess.run(cli, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent)
    assert completed.returncode == 0, completed.stderr[-3000:]
    (cli_file,) = (tmp_path / "cli").rglob("results_*.json")
    assert run_main(["--model", str(tiny_model_dir), "--tasks", "mmlu,gsm8k", "--mmlu-dir", str(data["mmlu_csv"]),
                     "--gsm8k-dir", str(data["gsm8k_jsonl"]), "--limit", "3", "--max-gen-toks", "16",
                     "--device", "cpu", "--output", str(tmp_path / "run.json")]) == 0  # fmt: skip

    def scores(results):
        return {task: {k: v for k, v in m.items() if "stderr" not in k and k != "alias"} for task, m in
                results["results"].items()}  # fmt: skip

    ours, theirs = json.loads((tmp_path / "run.json").read_text()), json.loads(cli_file.read_text())
    assert scores(ours) == scores(theirs) and set(scores(ours)) == {*tasks.split(",")}


def test_a_relative_model_path_is_never_looked_up_on_the_hub(tmp_path, data, tiny_model_dir, monkeypatch):
    """`--model models/step-4000` (the docs' own form) is also a valid hub repo id: lm-eval asked huggingface.co
    for its sha with the local path in the request (a stall offline; a stranger's sha recorded where such a repo
    exists). The model is handed to lm-eval by its absolute path."""
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo_id, **_: asked.append(repo_id))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "step-4000").symlink_to(tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    code = run_main(["--model", "models/step-4000", "--tasks", "gsm8k", "--gsm8k-dir", str(data["gsm8k_jsonl"]),
                     "--limit", "1", "--max-gen-toks", "4", "--output", "results.json"])  # fmt: skip
    assert code == 0 and (tmp_path / "results.json").exists()
    assert "models/step-4000" not in asked, asked


def test_eval_run_under_a_multi_process_launcher_is_refused(tmp_path, data, tiny_model_dir, capsys, monkeypatch):
    """Under torchrun, lm-eval's HF model went into its own data-parallel mode: every rank but the first built other
    GSM8K few-shot prompts, and those ranks crashed formatting a table of None. One line instead, before any model."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    code = run_main(["--model", str(tiny_model_dir), "--tasks", "gsm8k", "--gsm8k-dir", str(data["gsm8k_jsonl"]),
                     "--output", str(tmp_path / "r.json")])  # fmt: skip
    said = capsys.readouterr().err
    assert code == 2 and said.count("\n") == 1 and "eval.run is one process (WORLD_SIZE is 2)" in said, said


def test_standalone_runner_on_both_layouts_writes_lm_eval_results(tmp_path, data, tiny_model_dir, capsys):
    scores = []
    for mmlu, gsm8k in (("mmlu_csv", "gsm8k_jsonl"), ("mmlu_parquet", "gsm8k_parquet")):
        output = tmp_path / f"{mmlu}.json"
        code = run_main(["--model", str(tiny_model_dir), "--tasks", "mmlu,gsm8k", "--mmlu-dir", str(data[mmlu]),
                         "--gsm8k-dir", str(data[gsm8k]), "--limit", "4", "--max-gen-toks", "16",
                         "--output", str(output)])  # fmt: skip
        assert code == 0
        results = json.loads(output.read_text())
        expected = {"mmlu_local_elementary_mathematics", "mmlu_local_high_school_computer_science", "gsm8k_local"}
        assert expected <= set(results["results"])
        assert results["n-samples"]["gsm8k_local"] == {"original": 8, "effective": 4}
        assert results["n-shot"]["gsm8k_local"] == 5 and results["n-shot"]["mmlu_local_elementary_mathematics"] == 5
        gsm = results["results"]["gsm8k_local"]
        assert {"exact_match,strict-match", "exact_match,flexible-extract"} <= set(gsm)
        scores.append({task: metrics.get("acc,none") for task, metrics in results["results"].items()})
    assert scores[0] == scores[1], "the same documents in either layout give the same scores"
    out = capsys.readouterr().out
    assert "elementary_mathematics" in out and "gsm8k_local" in out and "per document" in out
    assert run_main(["--model", str(tiny_model_dir), "--mmlu-dir", str(tmp_path / "no"), "--output", "x.json"]) == 2
    if not torch.cuda.is_available():  # sharding over GPUs is refused on a machine without them, before loading
        arguments = ["--model", str(tiny_model_dir), "--gsm8k-dir", str(data["gsm8k_jsonl"]), "--tasks", "gsm8k"]
        assert run_main([*arguments, "--parallelize", "--output", str(tmp_path / "x.json")]) == 2
        capsys.readouterr()
        # --device cuda without CUDA: one line before the model is loaded (was 349 lines and exit 1)
        assert run_main([*arguments, "--device", "cuda", "--output", str(tmp_path / "x.json")]) == 2
        assert capsys.readouterr().err == (
            "error: --device cuda: no CUDA device is visible on this machine (use --device cpu or auto)\n"
        )


def test_an_output_that_cannot_take_the_results_is_refused_before_the_evaluation(tmp_path, data, tiny_model_dir,
                                                                                  capsys):  # fmt: skip
    """Hours of evaluation used to end in IsADirectoryError (results lost), or replace the model's own config."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = (model / "config.json").read_bytes()
    (tmp_path / "a-file").write_text("")
    arguments = ["--model", str(model), "--tasks", "gsm8k", "--gsm8k-dir", str(data["gsm8k_jsonl"]), "--output"]
    for output, named in ((tmp_path, "is a directory"), (model / "config.json", "a file of the model"),
                          (tmp_path / "a-file" / "r.json", "cannot write there")):  # fmt: skip
        assert run_main([*arguments, str(output)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--output {output}" in err and named in err, err
    assert (model / "config.json").read_bytes() == config and not list(tmp_path.rglob("*.probe"))
    (model / "results.json").write_text('{"results": {}}')  # an earlier result beside the model may be replaced
    assert run_main([*arguments, str(model / "results.json"), "--limit", "2", "--max-gen-toks", "4"]) == 0
    assert json.loads((model / "results.json").read_text())["n-samples"]["gsm8k_local"]["effective"] == 2


def test_in_loop_hook_restores_rng_training_mode_and_the_tokenizer(tmp_path, data, tiny_model_dir):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = None  # as Llama-2's tokenizer: lm-eval gave the run's own tokenizer one, in place
    settings = BenchmarkSettings(["mmlu", "gsm8k"], str(data["mmlu_parquet"]), str(data["gsm8k_jsonl"]), limit=2,
                                 max_gen_toks=8)  # fmt: skip
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)
    before = capture_rng_state()
    model.train()
    scores = run_benchmarks(model, accelerator, tokenizer, settings, step=7, output_dir=tmp_path)
    after = capture_rng_state()
    assert model.training
    assert tokenizer.pad_token is None, "the run's tokenizer (exported with the model) is left as it was"
    assert torch.equal(before["torch"], after["torch"]) and before["python"] == after["python"]
    assert all(np.array_equal(a, b) for a, b in zip(before["numpy"], after["numpy"], strict=True))
    assert {"mmlu/acc", "gsm8k/exact_match_strict", "gsm8k/exact_match_flexible", "benchmark_seconds"} <= set(scores)
    results = json.loads((tmp_path / "eval" / "step-7.json").read_text())
    subjects = [f"mmlu_local_{s}" for s in fixtures.SUBJECTS]
    sizes = [results["n-samples"][task]["effective"] for task in subjects]
    weighted = sum(results["results"][task]["acc,none"] * n for task, n in zip(subjects, sizes, strict=True))
    assert scores["mmlu/acc"] == pytest.approx(weighted / sum(sizes)), "weighted by subject size, as lm-eval's group"
    # negative control: lm-eval itself reseeds, so without the hook the state does change
    evaluate(model, tokenizer, settings)
    assert not torch.equal(before["torch"], torch.get_rng_state())


def test_a_failing_benchmark_is_logged_and_training_goes_on(tmp_path, data, tiny_model_dir, caplog):
    from accelerate import Accelerator

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir).train()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    settings = BenchmarkSettings(["gsm8k"], gsm8k_dir=str(tmp_path / "vanished"))
    scores = run_benchmarks(model, Accelerator(cpu=True), tokenizer, settings, step=3, output_dir=tmp_path)
    assert scores == {} and model.training
    assert "step 3: benchmarks failed" in caplog.text and "vanished" in caplog.text


def test_a_full_disk_writing_the_results_is_logged_and_the_scores_still_reach_every_rank(tmp_path, data,
                                                                                         tiny_model_dir, caplog,
                                                                                         monkeypatch):  # fmt: skip
    """The main process writes eval/step-N.json after the other ranks have gone to wait for its scores: an exception
    there (ENOSPC) left run_benchmarks on the main process only, and the other ranks hung in the broadcast until the
    watchdog ended the run. Now it is logged, the scores are returned (they go to the metrics) and training goes on."""
    import errno

    from accelerate import Accelerator

    import eval.in_loop

    def full_disk(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(eval.in_loop, "write_results", full_disk)
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir).train()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    settings = BenchmarkSettings(["gsm8k"], gsm8k_dir=str(data["gsm8k_jsonl"]), limit=1, max_gen_toks=4)
    scores = run_benchmarks(model, Accelerator(cpu=True), tokenizer, settings, step=5, output_dir=tmp_path)
    assert "gsm8k/exact_match_strict" in scores and model.training
    assert "step 5: benchmark results not written to" in caplog.text and "No space left on device" in caplog.text


def test_lm_evals_cli_names_a_bad_directory_in_one_line(tmp_path):
    import subprocess
    import sys

    metadata = json.dumps({"mmlu_dir": str(tmp_path / "no_mmlu")})
    cli = [sys.executable, "-m", "lm_eval", "--model", "dummy", "--include_path", str(Path("eval/tasks").resolve()),
           "--tasks", "mmlu_local_anatomy", "--metadata", metadata, "--limit", "1"]  # fmt: skip
    documented = (Path(__file__).parent.parent / "docs/benchmarks.md").read_text()
    assert "--tasks mmlu_local,gsm8k_local --output_path " in documented, "the documented line saves its results"
    assert "parallelize=True,add_bos_token=False" in documented, "no BOS, as eval.run and training"
    completed = subprocess.run(cli, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent)
    assert completed.returncode != 0
    assert (
        completed.stderr.strip().splitlines()[-1]
        == f"error: mmlu_dir {tmp_path / 'no_mmlu'} does not exist or is not a directory"
    )
    assert "Traceback" not in completed.stderr


@pytest.mark.parametrize("layout", ["csv", "parquet"])
def test_real_mmlus_empty_question_loads_and_an_empty_choice_does_not_in_either_layout(tmp_path, layout):
    """MMLU's sociology test split has a row with an empty question (every copy keeps it): legal in both layouts. An
    empty choice is not, and is named by file and row in both."""

    def write(rows):  # the same rows as test and as dev split; returns the test split's file
        for split in ("dev", "test"):
            if layout == "csv":
                path = tmp_path / split / f"sociology_{split}.csv"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("".join(f'"{q}",{",".join(c)},{"ABCD"[a]}\n' for q, c, a in rows))
            else:
                path = tmp_path / "sociology" / f"{split}-0.parquet"
                path.parent.mkdir(parents=True, exist_ok=True)
                columns = {"question": [q for q, _, _ in rows], "subject": ["sociology"] * len(rows),
                           "choices": [c for _, c, _ in rows], "answer": [a for _, _, a in rows]}  # fmt: skip
                pq.write_table(pa.table(columns), path)
        return path

    write([("", ["w", "x", "y", "z"], 2), ("q", ["a", "b", "c", "d"], 0)])
    assert check_mmlu(tmp_path) == ["sociology"]
    assert load_mmlu_subject(tmp_path, "sociology")["test"][0]["question"] == ""
    path = write([("q", ["a", " ", "c", "d"], 0)])
    where = f"{path.name}:1" if layout == "csv" else f"{path.name}: row 0"
    with pytest.raises(BenchmarkDataError, match=f"{where}: choice B is empty"):
        check_mmlu(tmp_path)


def test_prompts_longer_than_the_positions_are_measured_before_the_run_and_counted_in_the_loop(tmp_path, data, corpus,
                                                                                               caplog):  # fmt: skip
    """Real 5-shot MMLU prompts were cut silently in the loop (2,942 tokens against 1,024 positions). Preflight now
    measures them exactly as the evaluation builds them, and the in-loop results count the cut ones."""
    import dataclasses
    import logging

    from accelerate import Accelerator

    from eval.harness import measure_prompts
    from recipes.config import ConfigError
    from recipes.training.benchmark_checks import check_prompt_lengths

    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    settings = BenchmarkSettings(["mmlu", "gsm8k"], str(data["mmlu_parquet"]), str(data["gsm8k_jsonl"]), limit=2,
                                 max_gen_toks=8)  # fmt: skip
    roomy = measure_prompts(settings, tokenizer, 4096)
    assert roomy.truncated == 0 and roomy.prompts > 0 and roomy.longest_tokens > 100
    positions = roomy.longest_tokens - 1  # the longest prompt (at least) is cut
    measured = measure_prompts(settings, tokenizer, positions)
    assert 0 < measured.truncated < measured.prompts

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=positions, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="eval"):
        scores = run_benchmarks(model, Accelerator(cpu=True), tokenizer, settings, step=3, output_dir=tmp_path)
    counted = json.loads((tmp_path / "eval" / "step-3.json").read_text())["prompt_lengths"]
    assert counted == dataclasses.asdict(measured), "preflight's measure is what the evaluation then cuts"
    assert scores["benchmark_truncated_prompts"] == measured.truncated
    assert f"step 3: {measured.truncated} of {measured.prompts} benchmark prompts are longer than the model's " \
           f"{positions:,} positions" in caplog.text  # fmt: skip

    with pytest.raises(ConfigError, match=f"Raise model_config.max_position_embeddings to "
                                          f"{positions + measured.most_over} or more"):  # fmt: skip
        check_prompt_lengths(settings, tokenizer, positions, strict=True)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pretrain"):
        check_prompt_lengths(settings, tokenizer, positions, strict=False)
        assert "benchmarks: " in caplog.text and "lm-eval cuts them" in caplog.text
        check_prompt_lengths(settings, tokenizer, positions + measured.most_over, strict=True)
    assert measure_prompts(settings, tokenizer, positions + measured.most_over).truncated == 0
    # trained on shorter rows than its positions (the 70B recipes: 2,048 of 4,096): not cut, but said at start
    trained = roomy.longest_tokens // 2
    past = measure_prompts(settings, tokenizer, 4096, trained)
    assert 0 < past.beyond_trained < past.prompts and past.truncated == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        check_prompt_lengths(settings, tokenizer, 4096, strict=True, trained=trained)
    said = f"{past.beyond_trained} of {past.prompts} benchmark prompts run past max_seq_length {trained:,}"
    assert said in caplog.text


def test_a_launch_that_ended_during_the_benchmarks_skips_them_once_at_that_step(tmp_path, monkeypatch):
    """A failure inside a forward pass on one rank (out of memory on its longest prompts, say) leaves the others in
    ZeRO-3's gathers until the hang watchdog ends the launch (exit 1, a requeue): the relaunch reached the same step
    and the same failure, forever. Now the relaunch skips that step's benchmarks, once, and says so."""
    from types import SimpleNamespace

    import eval.in_loop
    from recipes.training.callbacks import Benchmarks

    calls = []

    def dies(*args, **kwargs):
        calls.append(args[4])
        raise SystemExit(1)  # the watchdog's exit, as far as this launch is concerned

    monkeypatch.setattr(eval.in_loop, "run_benchmarks", dies)
    settings = BenchmarkSettings(tasks=["gsm8k"])
    trainer = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=True, num_processes=1),
                              state=SimpleNamespace(step=4),
                              signals=SimpleNamespace(received=None), due=lambda every: True, is_last_step=False,
                              metrics=SimpleNamespace(write=lambda step, scores: calls.append(("scores", step)),
                                                      live=lambda values: calls.append(values)),
                              model=None)  # fmt: skip
    first = Benchmarks(settings, None, tmp_path, eval_steps=4, every=1)
    first.on_train_start(trainer)
    with pytest.raises(SystemExit):
        first.on_step_end(trainer, None, None)
    assert json.loads((tmp_path / Benchmarks.RUNNING_MARKER).read_text()) == {"step": 4}
    monkeypatch.setattr(eval.in_loop, "run_benchmarks", lambda *args, **kwargs: calls.append(args[4]) or {"x": 1.0})
    relaunch = Benchmarks(settings, None, tmp_path, eval_steps=4, every=1)
    relaunch.on_train_start(trainer)
    relaunch.on_step_end(trainer, None, None)  # step 4 again: skipped
    trainer.state.step = 8
    relaunch.on_step_end(trainer, None, None)  # the next ones run
    running, stopped = {"benchmarks_running": 1}, {"benchmarks_running": 0}
    assert calls == [running, 4, stopped, running, 8, stopped, ("scores", 8)], "the endpoint says when they run"
    del calls[:]
    assert not (tmp_path / Benchmarks.RUNNING_MARKER).exists()
    fresh = Benchmarks(settings, None, tmp_path, eval_steps=4, every=1)
    fresh.on_train_start(trainer)
    assert fresh.skip_step is None
    # the marker cannot be written (a full disk): the benchmarks still run on this rank, as on the others
    import errno

    import recipes.training.callbacks

    def full_disk(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(recipes.training.callbacks, "atomic_write_text", full_disk)
    trainer.state.step = 12
    fresh.on_step_end(trainer, None, None)
    assert calls[-3:] == [12, stopped, ("scores", 12)]


@pytest.mark.parametrize(
    ("names", "refused"),
    [
        (["test-00000-of-00002.parquet"], True),  # the second shard never arrived
        (["test-00000-of-00001.parquet", "test-00000-of-00001 (1).parquet"], True),  # a second download beside it
        (["test-00000-of-00001.parquet", "test-00000-of-00002.parquet", "test-00001-of-00002.parquet"], True),
        (["test-00000-of-00002.parquet", "test-00001-of-00002.parquet"], False),
        (["test-0.parquet"], False),  # named otherwise: read as it is
    ],
)
def test_a_hub_snapshots_split_must_be_one_complete_set_of_shards(tmp_path, data, names, refused):
    """A missing shard loaded half a split, and a stale copy or an older revision's shards beside the set were loaded
    too (some questions twice): each is refused, naming the folder and the files."""
    source = Path(data["gsm8k_parquet"]) / "main"
    table = pq.read_table(next(source.glob("test-*.parquet")))
    folder = tmp_path / "gsm8k" / "main"
    folder.mkdir(parents=True)
    shutil.copy(next(source.glob("train-*.parquet")), folder / "train-00000-of-00001.parquet")
    for name in names:
        pq.write_table(table, folder / name)
    if refused:
        with pytest.raises(BenchmarkDataError, match=r"the test split's parquet files are not one complete set"):
            load_gsm8k(tmp_path / "gsm8k")
    else:
        assert len(load_gsm8k(tmp_path / "gsm8k")["test"]) == len(names) * table.num_rows


def test_benchmark_prompts_get_no_bos_token_as_training_never_fed_one(data, corpus):
    """lm-eval's HF model let a BOS-adding tokenizer (Llama's) put BOS before every prompt, a token training never
    feeds (documents are tokenized without special tokens, EOS between them); and preflight's measure of the prompts
    was then one token short of what the evaluation fed. Now neither the scored nor the generated prompts start with
    it, and the evaluation counts the prompts as preflight does."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from eval.harness import measure_prompts

    bpe = Tokenizer.from_file(str(corpus["tokenizer"] / "tokenizer.json"))
    bpe.add_special_tokens(["<s>"])
    bos = bpe.token_to_id("<s>")
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    base = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token=base.eos_token,
                                        pad_token=base.pad_token)  # fmt: skip
    assert tokenizer("Answer:")["input_ids"][0] == bos, "the tokenizer adds BOS by default"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id)).eval()  # fmt: skip
    first_tokens = []

    def record(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        if ids.shape[1] > 1:  # a prompt, not a generated token fed back
            first_tokens.extend(ids[:, 0].tolist())

    model.register_forward_pre_hook(record, with_kwargs=True)
    settings = BenchmarkSettings(["mmlu", "gsm8k"], str(data["mmlu_csv"]), str(data["gsm8k_jsonl"]), limit=2,
                                 batch_size=1, max_gen_toks=2)  # fmt: skip
    results = evaluate(model, tokenizer, settings)
    assert first_tokens and bos not in first_tokens, "no prompt starts with BOS"
    assert results["timings"]["generate_until_requests"] > 0 and results["timings"]["loglikelihood_requests"] > 0
    measured = measure_prompts(settings, tokenizer, 1024)
    assert results["prompt_lengths"]["longest_tokens"] == measured.longest_tokens


def test_one_process_keeps_no_few_shot_count_or_answer_budget_of_an_earlier_evaluation(data, corpus):
    """The kept tasks held what an evaluation wrote into their config: after a 0-shot evaluation every later one was
    0-shot (lm-eval keeps a config's 0), and an answer budget stayed. The ranks' kept requests (`eval.sharded`) were
    keyed by the few-shot count only, so an earlier budget came back with them."""
    from eval.harness import measure_prompts
    from eval.sharded import same_prompts_as_one_rank

    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])

    def settings(num_fewshot: int = 5, max_gen_toks: int | None = None) -> BenchmarkSettings:
        return BenchmarkSettings(["mmlu", "gsm8k"], str(data["mmlu_csv"]), str(data["gsm8k_jsonl"]), limit=4,
                                 num_fewshot=num_fewshot, max_gen_toks=max_gen_toks)  # fmt: skip

    five, zero, again = (measure_prompts(settings(shots), tokenizer, 4096).longest_tokens for shots in (5, 0, 5))
    assert zero < five == again
    cut = measure_prompts(settings(max_gen_toks=4000), tokenizer, 4096)
    assert cut.truncated > 0, "a budget of 4000 leaves 96 of 4096 positions to a prompt"
    assert measure_prompts(settings(), tokenizer, 4096).truncated == 0, "lm-eval's own 256 again"
    manager = task_manager(tuple(sorted(settings().metadata().items())), False)
    budgets = []
    with same_prompts_as_one_rank(0, 2, set()):  # as rank 0 of 2 builds its requests, kept on the task
        for budget in (4000, None):
            gsm8k = manager.load(["gsm8k_local"])["tasks"]["gsm8k_local"]
            if budget:  # as lm-eval's simple_evaluate writes it
                gsm8k.set_config(key="generation_kwargs", value={"max_gen_toks": budget}, update=True)
            gsm8k.build_all_requests(limit=4, rank=0, world_size=2)
            budgets.append({request.args[1].get("max_gen_toks") for request in gsm8k.instances})
    assert budgets == [{4000}, {None}]


def test_an_empty_task_list_and_hub_tasks_offline_are_refused_in_one_line(tmp_path, data, tiny_model_dir, capsys,
                                                                           monkeypatch):  # fmt: skip
    """`--tasks ""` passed the checks and failed with a traceback after the model had loaded; so did a hub task
    offline (datasets' ConnectionError; the recipe's start-up too, on rank 0). Refused now before any model, in one
    line that names the flag or key; "[] for none" is only the recipe's to say."""
    from recipes.training.benchmark_checks import RECIPE_KEYS

    output = ["--output", str(tmp_path / "r.json")]
    for tasks in ("", ",", " , "):
        assert run_main(["--model", str(tiny_model_dir), "--tasks", tasks, *output]) == 2
        said = capsys.readouterr().err
        assert said.count("\n") == 1 and "--tasks: no task given; supported: ['mmlu', 'gsm8k']" in said, said
    with pytest.raises(ValueError) as refused:
        BenchmarkSettings(["hellaswag"]).check()
    assert str(refused.value) == "--tasks: ['hellaswag'] unknown; supported: ['mmlu', 'gsm8k']"
    with pytest.raises(ValueError, match=r"^eval_tasks: \['hellaswag'\] unknown; .* \(or \[\] for none\)$"):
        BenchmarkSettings(["hellaswag"]).check(RECIPE_KEYS)
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = run_main(["--model", str(tiny_model_dir), "--gsm8k-dir", str(data["gsm8k_jsonl"]), *output])
    said = capsys.readouterr().err
    assert code == 2 and said.count("\n") == 1 and "--mmlu-dir: not set, so mmlu would be read from the Hugging Face " \
        "hub (cais/mmlu, not in this machine's cache), but HF_HUB_OFFLINE=1 keeps this process off the network" \
        in said, said  # fmt: skip
    (tmp_path / "hub" / "datasets--cais--mmlu").mkdir(parents=True)  # cached on a login node: offline mode reads it
    BenchmarkSettings(["mmlu"]).check()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "true")
    with pytest.raises(ValueError, match=r"^gsm8k_dir: not set, so gsm8k .* HF_DATASETS_OFFLINE=true .* set gsm8k_dir"):
        BenchmarkSettings(["mmlu", "gsm8k"], str(data["mmlu_csv"])).check(RECIPE_KEYS)
    BenchmarkSettings(["mmlu", "gsm8k"], str(data["mmlu_csv"]), str(data["gsm8k_jsonl"])).check(RECIPE_KEYS)
    assert not (tmp_path / "r.json").exists()


def test_a_failure_writing_the_samples_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    """The samples file was opened for writing in place: a full disk or a kill part-way left it cut."""
    from eval.harness import write_samples

    path = tmp_path / "step-1-samples.jsonl"
    records = {"gsm8k_local": [{"doc_id": 0, "filter": "strict-match"}, {"doc_id": 1, "filter": "strict-match"}]}
    write_samples(records, path)
    before = path.read_text()
    assert len(before.splitlines()) == 2
    dumps = json.dumps

    def full_disk_on_the_second(value, *args, **kwargs):
        if value.get("doc_id") == 1:
            raise OSError(28, "No space left on device")
        return dumps(value, *args, **kwargs)

    monkeypatch.setattr(json, "dumps", full_disk_on_the_second)
    with pytest.raises(OSError):
        write_samples(records, path)
    assert path.read_text() == before


def test_a_gsm8k_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    """A latin-1 byte let Python's UnicodeDecodeError out, naming neither the file nor the line."""
    good = json.dumps({"question": "q", "answer": "so #### 4"}) + "\n"
    (tmp_path / "train.jsonl").write_text(good)
    (tmp_path / "test.jsonl").write_bytes(good.encode() * 2 + b'{"question": "caf\xe9", "answer": "so #### 4"}\n')
    with pytest.raises(BenchmarkDataError) as refused:
        check_gsm8k(tmp_path)
    assert str(refused.value) == f"{tmp_path / 'test.jsonl'}:3: not UTF-8 (byte 17 of the line); save it as UTF-8"
