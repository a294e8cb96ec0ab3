"""Launched by tests/test_zero3_parity.py on 2 CPU processes: two optimizer steps of the recipe's real
ZeRO-3 path (accelerator, partitioned model, offloaded DeepSpeedCPUAdam, gradient accumulation) against
plain single-process torch AdamW on the same global batch. Writes the differences as JSON."""

import json
import sys

import deepspeed
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from recipes.config import load_config
from recipes.config.deepspeed import offloads_optimizer
from recipes.training.model import build_model, build_optimizer, llama_config, optimizer_param_groups
from recipes.training.startup import setup_distributed

STEPS = 2


def main(recipe: str, output: str, overrides: list[str]) -> None:
    config = load_config(recipe, overrides)
    accelerator, ds_config = setup_distributed(config)
    world, rank = accelerator.num_processes, accelerator.process_index
    micro, accumulation = config.per_device_train_batch_size, config.gradient_accumulation_steps
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_name_or_path)
    model_config = llama_config(config, len(tokenizer))
    torch.manual_seed(config.seed)
    model = build_model(config, model_config, "sdpa", torch.float32)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model_config._attn_implementation = "sdpa"
    reference = LlamaForCausalLM(model_config)  # the class itself never enters ZeRO-3's partitioned init
    reference.load_state_dict(state)
    reference_optimizer = torch.optim.AdamW(
        optimizer_param_groups(reference, config.weight_decay),
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
    )
    optimizer = build_optimizer(model, config, offloads_optimizer(ds_config))
    engine, optimizer = accelerator.prepare(model, optimizer)

    generator = torch.Generator().manual_seed(1234)
    grad_norms = []
    for _ in range(STEPS):
        rows = torch.randint(0, len(tokenizer), (world * accumulation * micro, 32), generator=generator)
        for index in range(accumulation):
            accelerator.sync_gradients = index == accumulation - 1
            start = (index * world + rank) * micro
            batch = rows[start : start + micro]
            accelerator.backward(engine(input_ids=batch, labels=batch).loss)
        reference_loss = reference(input_ids=rows, labels=rows).loss
        reference_loss.backward()
        reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), config.max_grad_norm).item()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        grad_norms.append([float(engine.get_global_grad_norm()), reference_norm])

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        differences = {
            name: (param.detach() - reference_param.detach()).abs().max().item()
            for (name, param), reference_param in zip(
                engine.module.named_parameters(), reference.parameters(), strict=True
            )
        }
    if accelerator.is_main_process:
        with open(output, "w") as handle:
            json.dump({"max_abs_param_diff": differences, "grad_norms": grad_norms, "world_size": world}, handle)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    from common.process import run_as_rank

    run_as_rank(lambda: main(sys.argv[1], sys.argv[2], sys.argv[3:]))
