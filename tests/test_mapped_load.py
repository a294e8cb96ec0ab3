"""A resume maps each rank's optimizer file (recipes.training.mapped_load): DeepSpeed read it whole into anonymous
memory, 12 bytes per parameter above the steady state at the resume's peak (~830 GB more on one node at 70B)."""

import gc
from types import SimpleNamespace

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from recipes.training.mapped_load import mapped_loads


def anonymous_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon")) / 1024


def test_an_optimizer_file_is_mapped_not_read_whole_and_loads_the_same_values(tmp_path):
    saved = {"fp32_flat_groups": [torch.arange(40_000_000, dtype=torch.float32)], "step": 7}  # 160 MB
    torch.save(saved, tmp_path / "optim_states.pt")
    engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    gc.collect()
    before = anonymous_mb()
    with mapped_loads(engine):
        loaded = engine.checkpoint_engine.load(str(tmp_path / "optim_states.pt"), map_location="cpu")
    grown = anonymous_mb() - before
    assert grown < 40, f"the load took {grown:.0f} MB of anonymous memory for a 160 MB file"
    assert torch.equal(loaded["fp32_flat_groups"][0], saved["fp32_flat_groups"][0]) and loaded["step"] == 7
    assert "load" not in vars(engine.checkpoint_engine), "the engine's own load is back after the resume"
    del loaded
    gc.collect()
    before = anonymous_mb()
    whole = engine.checkpoint_engine.load(str(tmp_path / "optim_states.pt"), map_location="cpu")
    assert anonymous_mb() - before > 120, "the control: DeepSpeed's own load reads the file whole"
    del whole


def test_a_file_saved_without_the_zip_format_is_read_whole(tmp_path):
    torch.save({"a": torch.ones(3)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    with mapped_loads(engine):
        assert torch.equal(engine.checkpoint_engine.load(str(tmp_path / "legacy.pt"))["a"], torch.ones(3))


def test_the_loaded_moments_are_copied_out_so_a_deleted_checkpoint_frees_its_disk(tmp_path):
    """torch's load_state_dict kept an offloaded optimizer's moments as views of the mapped file: deleting the
    checkpoint (rotation) freed nothing while the run lived (~830 GB at 70B). They are copied out after the load."""
    param = torch.nn.Parameter(torch.zeros(1_000_000))
    adam = torch.optim.Adam([param])
    param.grad = torch.ones_like(param)
    adam.step()
    path = tmp_path / "optim_states.pt"
    torch.save({"optimizer": adam.state_dict()}, path)
    resumed = torch.optim.Adam([param])
    engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine(), optimizer=SimpleNamespace(optimizer=resumed))
    with mapped_loads(engine):
        resumed.load_state_dict(engine.checkpoint_engine.load(str(path), map_location="cpu")["optimizer"])
    gc.collect()
    with open("/proc/self/maps") as maps:
        assert str(path.resolve()) not in maps.read(), "the optimizer's state still maps the checkpoint's file"
    assert torch.equal(resumed.state[param]["exp_avg"], adam.state[param]["exp_avg"])
