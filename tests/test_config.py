"""Every shipped recipe loads and validates; overrides, unknown keys and cross-field rules behave."""

from pathlib import Path

import pytest

from recipes.config import (
    ConfigError,
    PretrainConfig,
    config_from_dict,
    elastic_accumulation,
    load_config,
    validate_against_model,
    validate_for_world,
    warmup_fraction,
)
from tests.conftest import REPO

RECIPES = sorted((REPO / "recipes" / "configs").glob("*.yaml"))
SPEC_RECIPES = {"llama70b_a800x8.yaml": 8, "llama70b_a800x16.yaml": 16}


SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def minimal(**extra):
    return {
        "output_dir": "out",
        "tokenizer_name_or_path": "tok",
        "train_files": ["a.jsonl"],
        "model_config": dict(SHAPE),
        "max_steps": 10,
        "lr_scheduler_kwargs": {"min_lr": 0.0},
        **extra,
    }


def test_there_are_recipes_to_test():
    assert {p.name for p in RECIPES} >= {"tiny_cpu.yaml", *SPEC_RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_loads(path: Path):
    config = load_config(path)
    assert isinstance(config, PretrainConfig)
    assert config.global_batch_size is not None, "shipped recipes pin the global batch so a wrong launch is caught"
    assert "zero3_leaf_modules: [LlamaDecoderLayer]" in path.read_text(), "each recipe says its ZeRO-3 granularity"
    assert config.zero3_leaf_modules == ["LlamaDecoderLayer"] == PretrainConfig.__dataclass_fields__[
        "zero3_leaf_modules"].default_factory()  # fmt: skip


@pytest.mark.parametrize(("name", "world_size"), SPEC_RECIPES.items())
def test_spec_recipes_hold_every_value_of_the_spec_table(name, world_size):
    config = load_config(REPO / "recipes" / "configs" / name)
    validate_for_world(config, world_size)
    assert config.per_device_train_batch_size == 2
    assert config.gradient_accumulation_steps == {8: 8, 16: 4}[world_size]
    assert config.resolved_global_batch_size(world_size) == config.global_batch_size == 128
    assert config.max_seq_length == 2048
    assert (config.learning_rate, config.weight_decay) == (1e-4, 0.1)
    assert (config.adam_beta1, config.adam_beta2) == (0.9, 0.95)
    assert config.max_grad_norm == 1.0
    assert config.lr_scheduler_type == "cosine_with_min_lr"
    assert config.lr_scheduler_kwargs == {"min_lr": 1e-5}
    assert config.warmup_steps == 35_000
    assert config.total_tokens == 3_500_000_000_000 and config.num_train_epochs == 1
    assert config.max_steps == -1
    assert config.total_steps(world_size) == 13_351_440
    assert warmup_fraction(config, world_size) == pytest.approx(0.0026, abs=5e-5)
    assert (config.bf16, config.fp16) == (True, False)
    assert config.gradient_checkpointing and config.gradient_checkpointing_layers_per_checkpoint == 2
    assert config.attn_implementation == "flash_attention_2"
    assert (config.dataloader_num_workers, config.dataloader_pin_memory) == (16, True)
    assert (config.save_steps, config.logging_steps, config.eval_steps) == (1000, 10, 1000)
    assert config.early_stopping_patience == 3
    assert config.model_config == {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }


def test_overrides_coerce_types_and_reach_into_mappings():
    config = load_config(
        REPO / "recipes/configs/tiny_cpu.yaml",
        ["--learning_rate", "8e-4", "--model_config.num_hidden_layers", "2", "--bf16", "false", "--max_steps=7"],
    )
    assert config.learning_rate == 8e-4 and isinstance(config.learning_rate, float)
    assert config.model_config["num_hidden_layers"] == 2
    assert config.model_config["hidden_size"] == 128, "a dotted override changes one entry, not the mapping"
    assert config.bf16 is False and config.max_steps == 7


def test_a_whole_mapping_override_replaces_it():
    config = load_config(
        REPO / "recipes/configs/tiny_cpu.yaml",
        ["--lr_scheduler_type", "constant_with_warmup", "--lr_scheduler_kwargs", "{}"],
    )
    assert config.lr_scheduler_kwargs == {}


def test_yaml_exponent_floats_without_dot_are_numbers():
    assert config_from_dict(minimal(learning_rate="1e-4")).learning_rate == 1e-4
    assert config_from_dict(minimal(total_tokens="3.5e12", max_steps=-1)).total_tokens == 3_500_000_000_000


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        (minimal(learnin_rate=1e-4), ["learnin_rate", "learning_rate"]),
        (minimal(model_config={"hidden_sise": 64}), ["hidden_sise"]),
        (minimal(per_device_train_batch_size="two"), ["per_device_train_batch_size"]),
        (minimal(bf16=True, fp16=True), ["bf16", "fp16"]),
        (minimal(max_steps=-1), ["total_tokens"]),
        (minimal(lr_scheduler_kwargs={}), ["min_lr"]),
        (minimal(lr_scheduler_kwargs={"min_lr": 1.0}, learning_rate=0.1), ["min_lr", "learning_rate"]),
        (minimal(lr_scheduler_type="linear", lr_scheduler_kwargs={}), ["lr_scheduler_type"]),
        (minimal(global_batch_size=100, per_device_train_batch_size=8), ["global_batch_size"]),
        (minimal(early_stopping_patience=3), ["early_stopping_patience", "validation_files"]),
        (minimal(attn_implementation="flash"), ["attn_implementation"]),
        (minimal(model_name_or_path="ckpt/final"), ["model_name_or_path", "model_config"]),
        ({k: v for k, v in minimal().items() if k != "train_files"}, ["train_files"]),
        # values that used to train to the end (exit 0) or fail only once the model was built
        (minimal(adam_beta1=5), ["adam_beta1", "[0, 1)"]),
        (minimal(adam_beta2=1.0), ["adam_beta2"]),
        (minimal(max_grad_norm=-1), ["max_grad_norm", "positive finite"]),
        (minimal(learning_rate="inf"), ["learning_rate", "positive finite"]),
        (minimal(learning_rate="nan"), ["learning_rate"]),
        (minimal(model_config={"hidden_size": -64}), ["model_config.hidden_size", "positive int"]),
        (minimal(model_config={"hidden_size": 64.5}), ["model_config.hidden_size", "expected int"]),
        (minimal(model_config={"num_hidden_layers": "two"}), ["model_config.num_hidden_layers"]),
        (minimal(model_config={"hidden_size": 64, "num_attention_heads": 3}), ["hidden_size", "num_attention_heads"]),
        (minimal(model_config={"num_attention_heads": 4, "num_key_value_heads": 3}), ["num_key_value_heads"]),
        (minimal(prometheus_port=70000), ["prometheus_port", "1-65535"]),
        (minimal(prometheus_port=0), ["prometheus_port"]),
        (minimal(hang_timeout_s=0), ["hang_timeout_s"]),
        (minimal(metrics_linger_s=-1), ["metrics_linger_s", "0-600"]),
        (minimal(elastic=True), ["elastic", "global_batch_size"]),
        (minimal(elastic=True, global_batch_size=100, per_device_train_batch_size=8), ["global_batch_size", "8"]),
        (minimal(lr_scheduler_kwargs={"min_lr": "abc"}), ["lr_scheduler_kwargs.min_lr", "expected float"]),
        (minimal(attn_implementation="torch_varlen", bf16=False), ["torch_varlen", "bf16"]),
        (minimal(zero3_leaf_modules=["Llama Decoder"]), ["zero3_leaf_modules", "'Llama Decoder'", "not a class name"]),
        (minimal(zero3_leaf_modules=["LlamaMLP", "LlamaMLP"]), ["zero3_leaf_modules", "more than once"]),
        (minimal(zero3_leaf_modules={"LlamaMLP": 1}), ["zero3_leaf_modules", "expected a list"]),
        # a from-scratch shape without a size key trained LlamaConfig's default (a 7B shape) without a word
        *[
            (
                minimal(model_config={k: v for k, v in SHAPE.items() if k != key}),
                [f"model_config has no {key}", "model_name_or_path"],
            )
            for key in SHAPE
        ],
        (minimal(max_steps=-1, total_tokens=float("inf")), ["total_tokens", "expected int, got inf"]),
        (minimal(dataloader_num_workers=-1), ["dataloader_num_workers", ">= 0"]),
        (minimal(global_batch_size=-128), ["global_batch_size", ">= 1"]),
        (minimal(global_batch_size=0), ["global_batch_size", ">= 1"]),
        (minimal(hardware={"mfu": "x"}), ["hardware.mfu", "expected float"]),
    ],
)
def test_bad_values_name_the_fields(raw, names):
    with pytest.raises(ConfigError) as error:
        config_from_dict(raw)
    for name in names:
        assert name in str(error.value)


def test_world_size_must_give_the_global_batch():
    config = load_config(REPO / "recipes/configs/llama70b_a800x8.yaml")
    with pytest.raises(ConfigError) as error:
        validate_for_world(config, world_size=16)
    message = str(error.value)
    assert "global_batch_size is 128" in message and "256" in message and "Launch on 8 processes" in message


def test_an_elastic_run_keeps_its_global_batch_on_any_world_size_that_can():
    config = load_config(REPO / "recipes/configs/llama70b_a800x16.yaml")
    assert config.elastic, "the multi-node recipe continues on fewer nodes (its sbatch script asks for a range)"
    assert [elastic_accumulation(config, world) for world in (16, 8, 4, 1)] == [4, 8, 16, 64]
    with pytest.raises(ConfigError) as error:
        elastic_accumulation(config, 12)
    assert "cannot be kept on 12 processes" in str(error.value) and "1, 2, 4, 8, 16, 32, 64" in str(error.value)
    with pytest.raises(ConfigError, match=r"on 24 processes .* \(nodes of 8: 1, 2, 4, 8\)"):  # 3 nodes of 8 GPUs
        elastic_accumulation(config, 24, per_node=8)
    from recipes.config import usable_nodes

    # Slurm may start a --nodes=4-8 job on any count in the range: the most that keep the batch train, the rest wait
    assert [usable_nodes(config, given, 8) for given in (1, 2, 3, 5, 6, 7, 8, 9)] == [1, 2, 2, 4, 4, 4, 8, 8]
    not_elastic = load_config(REPO / "recipes/configs/llama70b_a800x8.yaml")
    assert usable_nodes(not_elastic, 3, 8) == 3


def test_max_steps_is_derived_from_tokens_and_floored():
    config = config_from_dict(
        minimal(max_steps=-1, total_tokens=10_000, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    )
    config.max_seq_length = 1000
    assert config.total_steps(world_size=2) == 2  # 10,000 / (4 rows x 1000 tokens) = 2.5


def test_model_rules_name_the_fields():
    config = config_from_dict(minimal())
    with pytest.raises(ConfigError, match="max_seq_length 2048 exceeds the model's max_position_embeddings 1024"):
        validate_against_model(config, vocab_size=32000, tokenizer_size=32000, max_positions=1024)
    with pytest.raises(ConfigError, match="vocab_size 32000 is smaller than the tokenizer's 32005"):
        validate_against_model(config, vocab_size=32000, tokenizer_size=32005, max_positions=4096)
    validate_against_model(config, vocab_size=32000, tokenizer_size=32000, max_positions=2048)
    validate_against_model(config, vocab_size=32000, max_positions=2048)  # the planner: no tokenizer read


def test_a_model_directory_needs_no_shape_and_hardware_numbers_are_numbers():
    """model_name_or_path brings its own shape (the planner reads its config.json); PyYAML loads `1e3` as a string."""
    config = config_from_dict(minimal(model_config={}, model_name_or_path="ckpt/final"))
    assert config.model_config == {}
    config = config_from_dict(minimal(hardware={"gpus": "8", "intra_node_gb_s": "1e3", "gpu_memory_gb": None}))
    assert config.hardware == {"gpus": 8, "intra_node_gb_s": 1000.0, "gpu_memory_gb": None}


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")


def test_model_config_values_are_coerced_to_their_types():
    config = config_from_dict(minimal(model_config={**SHAPE, "hidden_size": "64", "rms_norm_eps": "1e-5"}))
    assert config.model_config["hidden_size"] == 64 and config.model_config["rms_norm_eps"] == 1e-5


def test_help_lists_every_key_with_type_default_and_help_quickly():
    import dataclasses
    import subprocess
    import sys
    import time

    from recipes.config import PretrainConfig

    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "recipes/pretrain.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    seconds = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    for f in dataclasses.fields(PretrainConfig):
        assert f"--{f.name} " in result.stdout, f.name
        assert f.metadata["help"].split()[0] in result.stdout
    assert "Peak AdamW learning rate, reached at the end of warmup.\n" in result.stdout.replace("  ", "")
    assert "(type: float, default: 0.0001)" in result.stdout
    assert "(type: str, default: required)" in result.stdout  # output_dir
    assert "(type: list[dict] | None, default: None)" in result.stdout  # train_mixture
    # `--help` must not import torch (~2 s of imports): checked by what it imports, not by a timed assertion
    print(f"--help answered in {seconds:.2f} s")
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, runpy; sys.argv=['p','--help']\n"
         "try: runpy.run_path('recipes/pretrain.py', run_name='__main__')\n"
         "except SystemExit: pass\n"
         "print('torch' in sys.modules)"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert probe.stdout.strip().endswith("False"), probe.stdout[-300:]


def test_malformed_yaml_in_the_file_or_an_override_names_the_line_or_the_override(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("output_dir: out\nlr_scheduler_kwargs: {min_lr: 0\nseed: 1\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml:\d: not valid YAML \("):
        load_config(recipe)
    with pytest.raises(ConfigError, match=r"--lr_scheduler_kwargs '\{min_lr: 0': not a valid YAML value \("):
        load_config(REPO / "recipes/configs/tiny_cpu.yaml", ["--lr_scheduler_kwargs", "{min_lr: 0"])


def test_an_unknown_key_gets_the_nearest_one_and_where_it_came_from(tmp_path):
    with pytest.raises(
        ConfigError, match=r"unknown key --learnin_rate on the command line: did you mean learning_rate\?"
    ):
        load_config(REPO / "recipes/configs/tiny_cpu.yaml", ["--learnin_rate", "1e-4"])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((REPO / "recipes/configs/tiny_cpu.yaml").read_text() + "save_step: 10\n")
    with pytest.raises(ConfigError, match=rf"unknown key save_step in {recipe}: did you mean save_steps\?"):
        load_config(recipe)
    with pytest.raises(ConfigError, match=r"unknown key --zzz on the command line: `recipes/pretrain.py --help`"):
        load_config(REPO / "recipes/configs/tiny_cpu.yaml", ["--zzz", "1"])


def test_null_for_a_list_key_means_an_empty_list():
    """`--validation_files null` means no validation, as `[]` does (it used to be refused as "expected a list, got
    None", which told the user nothing they could do)."""
    from recipes.config import ConfigError, load_config

    config = load_config(REPO / "recipes/configs/tiny_cpu.yaml", ["--validation_files", "null", "--eval_tasks", "~",
                                                                  "--early_stopping_patience", "null"])  # fmt: skip
    assert config.validation_files == [] and config.eval_tasks == []
    with pytest.raises(ConfigError, match="early_stopping_patience needs validation_files"):
        load_config(REPO / "recipes/configs/tiny_cpu.yaml", ["--validation_files", "null"])
