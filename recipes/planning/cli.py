"""Plan before you spend: memory, time and cost of a recipe on given hardware.

    python -m recipes.plan --config recipes/configs/llama70b_a800x8.yaml [--gpus 8] [--nodes 1]
        [--gpu-memory-gb 80] [--host-memory-gb 1536] [--peak-tflops 312] [--profile a800-pcie]
        [--interconnect ib200] [--intra-node-gb-s 20] [--inter-node-gbps 200] [--host-link-gb-s 20]
        [--host-memory-gb-s 200] [--compute-efficiency 0.6] [--overlap 0.3] [--mfu 0.45]
        [--search] [--days N] [--tokens T] [--max-nodes N] [--json] [--key value ...]

With `--tokens T --days D`, the deadline: the smallest cluster of the recipe's node type (and ZeRO variant) that
trains T tokens in D days, or the fastest when none of up to `--max-nodes` does (recipes.planning.deadline).
`--search --max-nodes N` ranks the best configuration of every node count up to N.

Hardware defaults come from the recipe's `hardware` block; recipe keys are overridden as in
pretrain.py (`--total_tokens 2e12`). Pure arithmetic: nothing is allocated, so a 70B plan prints
in well under a second, and `recipes/pretrain.py` runs the same plan as its preflight.

Sources of the terms: ZeRO-3 model states as DeepSpeed's `estimate_zero3_model_states_mem_needs`
counts them; activations per Korthikanti et al. 2022 (34·s·b·h bytes per layer in 16-bit with a
fused attention kernel, no s² term); FLOPs per token 6N + 12·L·s·h (PaLM, appendix B). Step time from the
communication model of `recipes.planning.step_time` on the hardware profile's wires; `--mfu` replaces it with a
fixed utilisation.

Exit codes (docs/run-safety.md): 0 done; 2 bad input, one line. It writes no file.
"""

from __future__ import annotations

import dataclasses
import json
import math

from common.exit_codes import BAD_INPUT, DONE, OneLineParser, fail
from recipes.config import (
    HARDWARE_KEYS,
    ConfigError,
    load_config,
)
from recipes.config.deepspeed import load_deepspeed_json
from recipes.planning.deadline import DEFAULT_MAX_NODES
from recipes.planning.hardware import hardware_from
from recipes.planning.plan import DEFAULT_DEEPSPEED_JSON, make_plan
from recipes.planning.report import format_plan, format_reachable, json_summary, reachable
from recipes.planning.step_time import (
    GPU_PROFILES,
)


def parse_args(argv: list[str] | None):
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int)
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--gpu-memory-gb", type=float)
    parser.add_argument("--host-memory-gb", type=float)
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument("--profile", choices=sorted(GPU_PROFILES), help="GPU and server: bandwidths, peak")
    parser.add_argument("--interconnect", help="between nodes: ib100, ib200, ib400, ib800")
    parser.add_argument("--intra-node-gb-s", type=float, help="collective bandwidth per GPU inside a node")
    parser.add_argument("--inter-node-gbps", type=float, help="network bandwidth per node, Gb/s (line rate)")
    parser.add_argument("--host-link-gb-s", type=float, help="GPU-host bandwidth per GPU")
    parser.add_argument("--host-memory-gb-s", type=float, help="host memory bandwidth per node (CPU Adam)")
    parser.add_argument("--compute-efficiency", type=float, help="fraction of peak the matmuls reach")
    parser.add_argument("--overlap", type=float, help="fraction of the shorter of compute and communication hidden")
    parser.add_argument("--mfu", type=float, help="a fixed utilisation instead of the communication model")
    parser.add_argument("--target-tokens-per-s", type=float, help="a throughput someone promised, to check")
    parser.add_argument("--search", action="store_true", help="rank the configurations that fit by tokens/s")
    parser.add_argument("--days", type=float, help="the tokens reachable in this many days, and the compute-optimal "
                        "model for that compute")  # fmt: skip
    parser.add_argument("--tokens", type=float, help="with --days: the smallest cluster that trains this many tokens "
                        "in that many days")  # fmt: skip
    parser.add_argument("--max-nodes", type=int, help=f"the largest cluster --tokens/--days and --search consider "
                        f"(default {DEFAULT_MAX_NODES} with --tokens)")  # fmt: skip
    parser.add_argument("--deepspeed-config", default=str(DEFAULT_DEEPSPEED_JSON))
    parser.add_argument("--json", action="store_true")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        check_finite(args)
        config = load_config(args.config, overrides)
        hardware = hardware_from(config, **{key: getattr(args, key) for key in (
            *HARDWARE_KEYS, "peak_tflops")})  # fmt: skip
        ds_config = load_deepspeed_json(args.deepspeed_config)
        if args.target_tokens_per_s is not None and not args.target_tokens_per_s > 0:
            raise ConfigError(f"--target-tokens-per-s {args.target_tokens_per_s}: must be a positive rate")
        plan = make_plan(config, hardware, ds_config, target_tokens_per_s=args.target_tokens_per_s)
        if args.days is not None and (args.days <= 0 or not plan.expected_tokens_per_s):
            raise ConfigError(f"--days {args.days}: needs a positive number of days and a peak (--peak-tflops or "
                              "--profile)")  # fmt: skip
        check_cluster_flags(args)
    except ConfigError as error:
        return fail(str(error), BAD_INPUT)
    if args.tokens is not None or (args.search and args.max_nodes):
        return cluster_answer(args, config, hardware, ds_config, plan)
    days = reachable(plan, args.days) if args.days is not None else None
    if args.search:
        from recipes.planning.search import format_search, search

        ranked, shipped, rank = search(config, hardware, ds_config, vocab_size=plan.vocab_size)
        if args.json:
            print(json.dumps({"ranked": [{"choice": dataclasses.asdict(c), "expected_tokens_per_s":
                                          p.expected_tokens_per_s, "per_gpu_memory_gb": p.per_gpu_memory_gb["total"],
                                          "host_memory_per_node_gb": p.host_memory_per_node_gb}
                                         for c, p in ranked], "shipped_rank": rank}))  # fmt: skip
        else:
            print(format_search(ranked, shipped, rank, hardware))
        return DONE
    if args.json:
        print(json.dumps({**json_summary(plan), **(days or {})}))
    else:
        print(format_plan(plan, config) + ("\n" + format_reachable(days, plan) if days else ""))
    return DONE


def check_finite(args) -> None:
    """Every number flag finite: `--days nan` and `--tokens inf` pass any sign check (nan compares false), and
    printed "nanB tokens" or failed later on something else."""
    for key, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{key.replace('_', '-')} {value}: must be a finite number")


def check_cluster_flags(args) -> None:
    if args.tokens is not None and (args.days is None or not args.tokens > 0):
        raise ConfigError(f"--tokens {args.tokens}: give a positive token count, with --days (the deadline)")
    if args.max_nodes is not None and args.max_nodes < 1:
        raise ConfigError(f"--max-nodes {args.max_nodes}: must be at least 1")
    if args.max_nodes is not None and args.tokens is None and not args.search:
        raise ConfigError("--max-nodes goes with --tokens and --days (a deadline) or with --search")


def cluster_answer(args, config, hardware, ds_config, plan) -> int:
    """The deadline (--tokens, --days) or the ranking over node counts (--search --max-nodes)."""
    from recipes.planning.deadline import clusters, deadline_answer, format_clusters, format_deadline

    max_nodes = args.max_nodes or DEFAULT_MAX_NODES
    try:
        found = clusters(config, hardware, ds_config, max_nodes, vocab_size=plan.vocab_size)
    except ConfigError as error:
        return fail(str(error), BAD_INPUT)
    tokens = args.tokens or plan.total_steps * config.resolved_global_batch_size(hardware.gpus) * config.max_seq_length
    if args.tokens is not None:
        answer = deadline_answer(found, tokens, args.days, config, hardware, max_nodes)
        print(json.dumps(answer) if args.json else format_deadline(answer, hardware))
        return DONE
    if args.json:
        print(json.dumps({"clusters": [cluster.summary(tokens) for cluster in
                                       sorted(found, key=lambda cluster: -cluster.tokens_per_s)]}))  # fmt: skip
    else:
        print(format_clusters(found, tokens, hardware))
    return DONE


if __name__ == "__main__":
    raise SystemExit(main())
