"""A checkpoint's `universal/`: DeepSpeed's world-size-independent copy of it, converted by the recipe when a run
resumes on another number of processes (recipes.training.elastic), and how to tell whether one is whole."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from common.files import sha256_of
from recipes.training.checkpointing import UNIVERSAL_DIR, verify_files

# in universal/, written last by the recipe's conversion: every file, its size and sha256
UNIVERSAL_LISTING = "conversion.json"
UNIVERSAL_STATES = ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt")  # one folder per parameter under universal/.../zero/


def has_universal(directory: Path) -> bool:
    """The checkpoint holds a complete universal conversion (`universal/`, see `universal_problems`)."""
    return (Path(directory) / UNIVERSAL_DIR).is_dir() and not universal_problems(directory)


def presence(directory: Path) -> tuple[bool, list[str]]:
    """Whether the checkpoint has a `universal/`, and what is wrong with it (one check: it may read rank shards)."""
    present = (Path(directory) / UNIVERSAL_DIR).exists()
    return present, universal_problems(directory) if present else []


def universal_problems(directory: Path) -> list[str]:
    """What is wrong with a checkpoint's `universal/`: against the listing the recipe's conversion wrote into it, or,
    for one converted by hand (docs/slurm.md), against the parameters its rank shards name (every parameter's folder
    with its weights and Adam moments). A conversion killed at its start leaves an empty one."""
    directory = Path(directory)
    root = directory / UNIVERSAL_DIR
    zero = root / "pytorch_model" / "zero"
    if not zero.is_dir() or not any(zero.iterdir()):
        return [f"{zero} is missing or empty (a conversion that stopped at its start?)"]
    if (root / UNIVERSAL_LISTING).is_file():
        problems = []
        for name, entry in sorted(_universal_files(root).items()):
            path = root / name
            if not path.is_file():
                problems.append(f"{path} is missing")
            elif path.stat().st_size != entry["bytes"]:
                problems.append(f"{path} has {path.stat().st_size} bytes; the conversion wrote {entry['bytes']}")
        return problems
    names = _shard_parameter_names(directory)
    return [f"{zero / name / state} is missing" for name in names or [] for state in UNIVERSAL_STATES
            if not (zero / name / state).is_file()]  # fmt: skip


def universal_listing(root: Path, threads: int = 8) -> dict[str, dict]:
    """Every file under a universal conversion `root`, by relative path, with its size and sha256 (what
    `universal_problems` and `verify_universal_share` check it against). Hashed on `threads` threads (hashlib
    releases the GIL): at 70B the conversion holds ~840 GB of fp32 weights and Adam moments."""
    from concurrent.futures import ThreadPoolExecutor

    paths = [path for path in sorted(root.rglob("*")) if path.is_file()]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        hashes = list(pool.map(partial(sha256_of, sync=True), paths))  # on storage before vouched for
    return {str(path.relative_to(root)): {"bytes": path.stat().st_size, "sha256": digest}
            for path, digest in zip(paths, hashes, strict=True)}  # fmt: skip


def _universal_files(root: Path) -> dict[str, dict]:
    """The listing's files; one written before the listing held hashes gives sizes only."""
    files = json.loads((root / UNIVERSAL_LISTING).read_text())["files"]
    return {name: entry if isinstance(entry, dict) else {"bytes": entry} for name, entry in files.items()}


def verify_universal_share(directory: Path, rank: int, world_size: int) -> list[str]:
    """Re-hash this rank's share of `universal/`'s files against the conversion's listing (as `verify_share` does
    for the checkpoint's own files); a universal/ converted by hand, or before listings held hashes, has none."""
    root = Path(directory) / UNIVERSAL_DIR
    if not (root / UNIVERSAL_LISTING).is_file():
        return []
    hashed = {name: entry for name, entry in _universal_files(root).items() if "sha256" in entry}
    return verify_files(root, hashed, rank, world_size, f"the conversion's {UNIVERSAL_LISTING}")


def _shard_parameter_names(directory: Path) -> list[str] | None:
    """The parameter names rank 0's ZeRO model states record (None when the rank shards are gone)."""
    shards = sorted((directory / "pytorch_model").glob("zero_pp_rank_0_mp_rank_*_model_states.pt"))
    if not shards:
        return None
    import torch

    states = torch.load(shards[0], map_location="cpu", weights_only=False)
    return [name for group in states.get("param_shapes", []) for name in group]
