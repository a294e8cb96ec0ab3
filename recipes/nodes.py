"""How many of the nodes Slurm gave a job its recipe can train on (scripts/slurm/run.sh asks at every start).

    python -m recipes.nodes RECIPE --given N --per-node P [--key value ...]
    python -m recipes.nodes RECIPE --output-dir [--key value ...]

Prints one number: N for a recipe that is not elastic, else the most nodes up to N whose processes keep the recipe's
global batch (recipes.config.usable_nodes). Overrides that do not load are left out (the launch then refuses them in
one line), and a recipe that does not load prints N. With --output-dir, the run's output_dir instead (nothing for a
recipe that does not load): where the script looks for progress between two failures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recipes.config import ConfigError, load_config, usable_nodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--given", type=int, help="nodes in the job (SLURM_JOB_NUM_NODES)")
    parser.add_argument("--per-node", type=int, help="processes per node")
    parser.add_argument("--output-dir", action="store_true", help="print the run's output_dir instead")
    args, overrides = parser.parse_known_args(argv)
    if not args.output_dir and (args.given is None or args.per_node is None):
        parser.error("--given and --per-node are required (or --output-dir)")
    try:
        config = load_config(args.recipe, overrides)
    except ConfigError:  # an override the launch will refuse in one line: count with the recipe as written
        try:
            config = load_config(args.recipe, [])
        except ConfigError:
            print("" if args.output_dir else args.given)
            return 0
    print(config.output_dir if args.output_dir else usable_nodes(config, args.given, args.per_node) or args.given)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
