"""The accelerate configs and the shared ZeRO-3 JSON hold the SPEC values, and agree with the recipes."""

import json
import re
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from recipes.config import ConfigError, load_config
from recipes.config.deepspeed import load_deepspeed_json, resolve_deepspeed_config
from tests.conftest import REPO

ACCELERATE_CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))
RECIPES = sorted((REPO / "recipes" / "configs").glob("*.yaml"))


def ds_json_of(accelerate_config: Path) -> dict:
    raw = yaml.safe_load(accelerate_config.read_text())
    return load_deepspeed_json(REPO / raw["deepspeed_config"]["deepspeed_config_file"])


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_every_accelerate_config_selects_zero3_with_partitioned_init(path):
    config = load_config_from_file(str(path))  # accelerate's own loader: unknown keys would fail here
    assert config.distributed_type == "DEEPSPEED"
    assert config.deepspeed_config["zero3_init_flag"] is True
    assert config.use_cpu is False, "use_cpu would silently drop DeepSpeed for plain CPU DDP"
    ds = ds_json_of(path)
    assert ds["zero_optimization"]["stage"] == 3
    # Values the recipe owns are "auto" in the JSON so that each has one home.
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        assert ds[key] == "auto"
    assert ds["gradient_clipping"] == "auto" and ds["bf16"]["enabled"] == "auto"


def test_shared_zero3_json_holds_the_spec_values():
    ds = load_deepspeed_json(REPO / "accelerate_configs/deepspeed/zero3.json")
    zero = ds["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"]["device"] == "none"
    # stage 3 reads these. The source's "allgather_bucket_size 2e8" (a stage 1-2 key) would be the prefetch bucket, but
    # with each decoder layer a leaf (0.86B parameters at 70B) the prefetch and the live bound must hold a whole layer,
    # and two, for the next layer's gather to overlap this one's compute (the planner warns otherwise)
    assert zero["reduce_bucket_size"] == 2e8 and zero["stage3_prefetch_bucket_size"] == 9e8
    assert zero["stage3_max_live_parameters"] == 1.8e9 and zero["stage3_max_reuse_distance"] == 1e9
    assert zero["stage3_param_persistence_threshold"] == 1e5
    assert not {"allgather_partitions", "allgather_bucket_size"} & set(zero), "stage 1-2 keys that stage 3 ignores"
    assert zero["overlap_comm"] is True
    # nothing in the recipe saves a 16-bit model (checkpoints hold the fp32 master weights; final/ is exported from
    # them): true claimed a gather at save that never happened
    assert zero["stage3_gather_16bit_weights_on_model_save"] is False


def test_emergency_variant_differs_only_in_offload_param():
    base = load_deepspeed_json(REPO / "accelerate_configs/deepspeed/zero3.json")
    variant = load_deepspeed_json(REPO / "accelerate_configs/deepspeed/zero3_offload_param.json")
    assert variant["zero_optimization"].pop("offload_param")["device"] == "cpu"
    base["zero_optimization"].pop("offload_param")
    assert variant == base


def test_zeropp_variant_differs_only_in_the_zeropp_keys_and_deepspeed_accepts_them():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    base = load_deepspeed_json(REPO / "accelerate_configs/deepspeed/zero3.json")
    variant = load_deepspeed_json(REPO / "accelerate_configs/deepspeed/zero3pp.json")
    zero = DeepSpeedZeroConfig(**variant["zero_optimization"])  # DeepSpeed's own validation of the section
    assert zero.zero_hpz_partition_size == 8 and zero.zero_quantized_weights and zero.zero_quantized_gradients
    for key in ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients"):
        variant["zero_optimization"].pop(key)
    assert variant == base
    assert (
        ds_json_of(REPO / "accelerate_configs/zero3pp_16gpu.yaml")["zero_optimization"]["zero_hpz_partition_size"] == 8
    )


def test_topologies():
    eight = load_config_from_file(str(REPO / "accelerate_configs/zero3_8gpu.yaml"))
    sixteen = load_config_from_file(str(REPO / "accelerate_configs/zero3_16gpu.yaml"))
    cpu = load_config_from_file(str(REPO / "accelerate_configs/zero3_cpu.yaml"))
    assert (eight.num_machines, eight.num_processes) == (1, 8)
    assert (sixteen.num_machines, sixteen.num_processes) == (2, 16)
    assert sixteen.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
    assert "main_process_ip" not in yaml.safe_load((REPO / "accelerate_configs/zero3_16gpu.yaml").read_text())
    assert (cpu.num_machines, cpu.num_processes) == (1, 2)
    for config in (eight, sixteen):
        assert ds_json_of(Path(REPO / "accelerate_configs/zero3_8gpu.yaml")) == load_deepspeed_json(
            REPO / config.deepspeed_config["deepspeed_config_file"]
        ), "the 8- and 16-GPU launches share one ZeRO-3 JSON"


LAUNCH_CONFIG = re.compile(r"--config_file (accelerate_configs/\S+\.yaml)")


@pytest.mark.parametrize("recipe_path", RECIPES, ids=lambda p: p.name)
def test_recipe_header_launch_command_agrees_on_batch_arithmetic(recipe_path):
    """The launch command written in each recipe's header names an accelerate config whose process count
    gives the recipe's global batch: micro x accumulation x world size."""
    header = "".join(line for line in recipe_path.read_text().splitlines(True) if line.startswith("#"))
    match = LAUNCH_CONFIG.search(header)
    assert match, f"{recipe_path.name}: header has no `accelerate launch --config_file ...` command"
    assert f"--config recipes/configs/{recipe_path.name}" in header
    launch = load_config_from_file(str(REPO / match.group(1)))
    recipe = load_config(recipe_path)
    assert (
        recipe.per_device_train_batch_size * recipe.gradient_accumulation_steps * launch.num_processes
        == recipe.global_batch_size
    )


def test_resolution_fills_recipe_values_and_refuses_conflicts():
    recipe = load_config(REPO / "recipes/configs/llama70b_a800x16.yaml")
    ds = load_deepspeed_json(REPO / "accelerate_configs/deepspeed/zero3.json")
    resolved = resolve_deepspeed_config(ds, recipe, world_size=16)
    assert resolved["train_micro_batch_size_per_gpu"] == 2
    assert resolved["gradient_accumulation_steps"] == 4
    assert resolved["train_batch_size"] == 128
    assert resolved["gradient_clipping"] == 1.0
    assert resolved["bf16"]["enabled"] is True and resolved["fp16"]["enabled"] is False
    assert resolved["zero_force_ds_cpu_optimizer"] is False
    assert ds["gradient_clipping"] == "auto", "the loaded JSON itself is left untouched"
    json.dumps(resolved)

    ds["gradient_clipping"] = 0.5
    with pytest.raises(ConfigError, match=r"gradient_clipping: DeepSpeed JSON says 0.5, recipe gives 1.0"):
        resolve_deepspeed_config(ds, recipe, world_size=16)


def test_deepspeed_json_must_be_stage_3(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match="stage must be 3"):
        load_deepspeed_json(path)
