"""A resume that maps each rank's optimizer file instead of reading it whole.

DeepSpeed's checkpoint engine reads a rank's ZeRO-3 optimizer file (fp32 master weights and both Adam moments, 12
bytes per parameter: ~103 GB per rank at 70B on 8 GPUs) whole into anonymous memory before copying it into place,
while the offloaded master weights and gradient buffers already exist: a resume's host peak was 12 bytes per parameter
above the steady state (~830 GB more on one node at 70B). Mapped (`torch.load(mmap=True)`), the file's pages are page
cache, which the kernel can drop: the master weights are copied out of it, then the moments, one tensor at a time
(`copy_out_of_files`: kept mapped, they held the file's disk space after the checkpoint was deleted), and the peak
is the steady state's.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

logger = logging.getLogger("pretrain")

# torch's words for a file saved without the zip format (DeepSpeed's `checkpoint_serialization: false`)
NOT_MAPPABLE = "mmap can only be used with files saved with"


def mapped_torch_load(path, map_location=None):
    """DeepSpeed's TorchCheckpointEngine.load, mapped; a file torch cannot map is read whole as before."""
    try:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=True)
    except RuntimeError as error:
        if NOT_MAPPABLE not in str(error):
            raise
        logger.info("%s is not in torch's zip format: read whole into host memory", path)
        return torch.load(path, map_location=map_location, weights_only=False)


@contextlib.contextmanager
def mapped_loads(engine):
    """Within: `engine` (a DeepSpeedEngine) maps the files it loads; after, the optimizer's state is copied out of
    them. Only DeepSpeed's plain torch engine is changed; another checkpoint engine (Nebula, fast or decoupled
    writers) loads its own way."""
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if type(checkpoint_engine).__name__ != "TorchCheckpointEngine":
        yield
        return
    mapped: list[str] = []

    def load(path, map_location=None):
        mapped.append(os.path.realpath(path))
        return mapped_torch_load(path, map_location)

    checkpoint_engine.load = load
    try:
        yield
    finally:
        del checkpoint_engine.load  # the class's own method again
    optimizer = getattr(engine, "optimizer", None)
    copy_out_of_files(getattr(optimizer, "optimizer", optimizer), mapped)


def copy_out_of_files(optimizer, paths: list[str]) -> int:
    """Copy each state tensor of `optimizer` that lies in a mapping of one of `paths` into memory of its own, one
    at a time; returns how many. torch's load_state_dict keeps an offloaded optimizer's loaded moments as they are
    (same device, same dtype): views of the whole mapped file, which then stayed mapped for the life of the process,
    so deleting that checkpoint (rotation, a rollback's successor) freed no disk (~830 GB at 70B)."""
    ranges = mapped_ranges(paths)
    copied = 0
    for state in getattr(optimizer, "state", {}).values():
        for key, value in list(state.items()):
            if torch.is_tensor(value) and value.device.type == "cpu" and in_ranges(value.data_ptr(), ranges):
                state[key] = value.clone()
                copied += 1
    return copied


def mapped_ranges(paths: list[str]) -> list[tuple[int, int]]:
    """The address ranges of this process that map one of `paths` (Linux's /proc/self/maps; none elsewhere)."""
    wanted = set(paths)
    ranges = []
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n").removesuffix(" (deleted)") in wanted:
                start, end = (int(address, 16) for address in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def in_ranges(address: int, ranges: list[tuple[int, int]]) -> bool:
    return any(start <= address < end for start, end in ranges)
