"""What `python -m recipes.export` (and the run's `final/`) reads of a checkpoint, and the weights it writes from it.

A checkpoint's weights are read from its per-rank ZeRO-3 shards when all of them are there, else from its `universal/`
form (after a world-size change the rank shards may have been deleted, or only some of them kept). Before anything
is read: every file of the form read is hashed against its record (the manifest, `universal/conversion.json`), a
file the record does not list is refused (it would be read unchecked), and the model config the export builds is
compared with the shape the run trained with (`run_identity.json`). Weights are written one output shard at a time;
a tied output head (`tie_word_embeddings`) is written once, as the embedding, as `save_pretrained` does."""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from common.files import sha256_of
from common.lock import FileLock
from recipes.config import MODEL_CONFIG_KEYS, ConfigError
from recipes.training import checkpointing, universal

logger = logging.getLogger("pretrain")
SHARDS, UNIVERSAL = "the rank shards", "universal/"  # the forms an export reads the weights from
# errors of a checkpoint on storage this user cannot write (a read-only mount, a teammate's run): no reader pin
UNPINNABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def weights_source(checkpoint: Path) -> tuple[str, list[str]]:
    """The form the export reads `checkpoint`'s weights from, and what is wrong with the checkpoint for it: the rank
    shards when the manifest's are all there (and no unlisted one), else `universal/` when it is complete."""
    if not checkpoint.is_dir():
        return SHARDS, [f"{checkpoint} does not exist"]
    problems = checkpointing.manifest_problems(checkpoint)
    shards = f"{checkpoint / 'pytorch_model'}/"
    rest = [problem for problem in problems if shards not in problem]
    if rest != problems and universal.has_universal(checkpoint):  # rank shards deleted once converted, or some
        return UNIVERSAL, rest
    return SHARDS, problems or unlisted_rank_files(checkpoint)


def unlisted_rank_files(checkpoint: Path) -> list[str]:
    """`pytorch_model/` files the manifest does not list: DeepSpeed's consolidation reads every `*_states.pt` there,
    and a file the save did not write would be read without a hash to check it against."""
    if not (checkpoint / checkpointing.MANIFEST).is_file():
        return []
    listed = checkpointing.read_manifest(checkpoint)["files"]
    return [f"{path} is not in {checkpointing.MANIFEST} (not written by the save: move it out of the checkpoint)"
            for path in sorted((checkpoint / "pytorch_model").rglob("*.pt"))
            if str(path.relative_to(checkpoint)) not in listed]  # fmt: skip


def verified_problems(checkpoint: Path, source: str) -> list[str]:
    """Every file the export reads, re-hashed: the whole checkpoint, or with `universal/` the checkpoint's own
    files outside `pytorch_model/` (rank shards it does not read are not hashed) and `universal/`'s files."""
    if source == SHARDS:
        return checkpointing.verify_checksums(checkpoint)
    files = checkpointing.read_manifest(checkpoint)["files"]
    own = {name: entry for name, entry in files.items() if not name.startswith("pytorch_model/")}
    problems = [f"{checkpoint / name}: sha256 differs from the manifest (the file was changed or damaged)"
                for name, entry in sorted(own.items()) if sha256_of(checkpoint / name) != entry["sha256"]]  # fmt: skip
    return problems + verified_universal(checkpoint)


def verified_universal(checkpoint: Path) -> list[str]:
    """`universal/`'s files against the listing its conversion wrote (`verify_universal_share`); a weights file it
    does not list is refused. One converted by hand (no listing), or before listings held hashes, is read as it is,
    with a warning."""
    root = checkpoint / checkpointing.UNIVERSAL_DIR
    listing = root / universal.UNIVERSAL_LISTING
    if not listing.is_file():
        logger.warning("%s has no %s (converted by hand?): its files cannot be checked against hashes and are "
                       "exported as they are", root, universal.UNIVERSAL_LISTING)  # fmt: skip
        return []
    listed = json.loads(listing.read_text())["files"]
    if not any(isinstance(entry, dict) and "sha256" in entry for entry in listed.values()):
        logger.warning("%s lists sizes only (an older conversion): %s is exported unhashed", listing, root)
    unlisted = [f"{path} is not in {listing} (not written by the conversion: move it out of the checkpoint)"
                for path in sorted((root / "pytorch_model" / "zero").rglob("fp32.pt"))
                if str(path.relative_to(root)) not in listed]  # fmt: skip
    return unlisted + universal.verify_universal_share(checkpoint, 0, 1)


def shape_changes(checkpoint: Path, model_config) -> list[str]:
    """What of the model config the export built differs from the shape the run trained with (`model_shape` in the
    checkpoint's run_identity.json, as `recipes.training.resume.run_identity` records it): with model_name_or_path the
    config is read again from that directory, which may have been edited since. None to compare before identities."""
    from recipes.training.resume import RUN_IDENTITY

    path = checkpoint / RUN_IDENTITY
    recorded = json.loads(path.read_text()).get("model_shape") if path.is_file() else None
    if not isinstance(recorded, dict):
        return []
    built = {key: getattr(model_config, key, None) for key in (*MODEL_CONFIG_KEYS, "rope_parameters")}
    built = json.loads(json.dumps(built, default=str))  # as recorded: tuples as lists
    return [f"{key} {recorded.get(key)!r} -> {built.get(key)!r}" for key in sorted(set(recorded) | set(built))
            if recorded.get(key) != built.get(key)]  # fmt: skip


@contextmanager
def reader_pinned(checkpoint: Path) -> Iterator[None]:
    """The checkpoint's reader pin (`checkpointing.reader_pin`) held while the export reads it, so a live run's
    rotation keeps it. On storage this user cannot write (a read-only mount, a teammate's run) there is no pin to
    take: the export warns and reads on (a rotation meanwhile fails it, one line, and nothing is published)."""
    pin = FileLock(checkpointing.reader_pin(checkpoint), shared=True)
    try:
        pin.acquire()
    except OSError as error:
        if error.errno not in UNPINNABLE:
            raise
        logger.warning("cannot pin %s against rotation (%s: %s): exporting it without the pin; a run that rotates "
                       "it meanwhile would fail this export", checkpoint, pin.path, error.strerror)  # fmt: skip
        yield
        return
    try:
        yield
    finally:
        pin.release()


def write_weights(checkpoint: Path, staging: Path, dtype: str, max_shard_size: str, model_config, source: str) -> None:
    """Sharded safetensors of the model's parameters, from the rank shards through DeepSpeed's lazy consolidation
    (optimizer files memory-mapped) or from `universal/` (one `zero/<name>/fp32.pt` of flat fp32 per parameter)."""
    import torch

    target, shapes = getattr(torch, dtype), parameter_shapes(model_config)
    if source == SHARDS:
        from deepspeed.utils import zero_to_fp32

        lazy = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model",
                                                                     lazy_mode=True)  # fmt: skip
        missing = [name for name in shapes if name not in lazy]
        kept = {id(lazy[name]) for name in shapes if name in lazy}  # a tied head is the embedding's own object
        extra = [name for name, tensor in lazy.items() if name not in shapes and id(tensor) not in kept]

        def load(name: str):
            return zero_to_fp32.to_torch_tensor({name: lazy.pop(name)}, dtype=target)[name]
    else:
        zero_dir = checkpoint / checkpointing.UNIVERSAL_DIR / "pytorch_model" / "zero"
        missing = [name for name in shapes if not (zero_dir / name / "fp32.pt").is_file()]
        extra = sorted(path.name for path in zero_dir.iterdir() if path.is_dir() and path.name not in shapes)

        def load(name: str):
            saved = torch.load(zero_dir / name / "fp32.pt", map_location="cpu", weights_only=False)
            return (saved["param"] if isinstance(saved, dict) else saved).reshape(shapes[name]).to(target).contiguous()

    if missing or extra:
        what = f"lack {len(missing)} of the model's tensors, e.g. {missing[0]}" if missing else \
            f"hold {len(extra)} tensor(s) the model config has not, e.g. {extra[0]}"  # fmt: skip
        raise ConfigError(f"cannot export {checkpoint}: the weights ({source}) {what}")
    _save_shards(shapes, load, target, staging, max_shard_size)


def causal_lm_class(model_config) -> type:
    """The transformers class of the model (`LlamaForCausalLM`), as AutoModelForCausalLM maps its config."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_config.model_type])


def parameter_shapes(model_config) -> dict:
    """Every tensor the model's state dict holds, with its shape, from a model built on the meta device (no memory);
    a tensor shared with another (a tied output head) once, under the name the state dict gives it first (the
    embedding: `from_pretrained` ties the head to it again, as for `save_pretrained`'s output). Built by its class,
    not `from_config`, which in the live run (final/) would build it inside ZeRO-3's partitioned init."""
    import torch

    with torch.device("meta"):
        model = causal_lm_class(model_config)(model_config)
    shapes, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            shapes[name] = tensor.shape
    return shapes


def _save_shards(shapes: dict, load: Callable, target, staging: Path, max_shard_size: str) -> None:
    """`load(name)` of every name in `shapes`, one output shard in memory at a time, with the index when sharded."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    empty = {name: torch.empty(shape, dtype=target, device="meta") for name, shape in shapes.items()}
    split = split_torch_state_dict_into_shards(empty, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)  # fmt: skip
    for filename, tensors in split.filename_to_tensors.items():
        save_file({name: load(name) for name in tensors}, staging / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
