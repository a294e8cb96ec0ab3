"""A resume that maps each rank's optimizer file instead of reading it whole.

DeepSpeed's checkpoint engine reads a rank's ZeRO-3 optimizer file (fp32 master weights and both Adam moments, 12
bytes per parameter: ~103 GB per rank at 70B on 8 GPUs) whole into anonymous memory before copying it into place,
while the offloaded master weights and gradient buffers already exist: a resume's host peak was 12 bytes per parameter
above the steady state (~830 GB more on one node at 70B). Mapped (`torch.load(mmap=True)`), the file's pages are page
cache, which the kernel can drop: the master weights are copied out of it, the moments stay mapped (copy on write)
until the first optimizer step writes them, and the peak is the steady state's.
"""

from __future__ import annotations

import contextlib
import logging

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
    """Within: `engine` (a DeepSpeedEngine) maps the files it loads. Only DeepSpeed's plain torch engine is
    changed; another checkpoint engine (Nebula, fast or decoupled writers) loads its own way."""
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if type(checkpoint_engine).__name__ != "TorchCheckpointEngine":
        yield
        return
    checkpoint_engine.load = mapped_torch_load
    try:
        yield
    finally:
        del checkpoint_engine.load  # the class's own method again
