"""Weighted mixtures of preprocessed directories: exact proportions as a pure function of the sample index, the
same rows on any world size, an exact resume, and a real 2-process run that logs each source's tokens."""

import itertools
import json
import shutil

import numpy as np
import pytest
import torch

from data_prep.packing.packed_dataset import PackedRows
from data_prep.parts.mixture import Blend, MixedRows, MixtureError
from data_prep.preprocessing.pipeline import preprocess
from recipes.config import ConfigError, PretrainConfig, config_from_dict
from recipes.telemetry.metrics import read_metrics
from recipes.training.train_data import TrainData
from tests.conftest import REPO, launch, tiny_overrides


def window_errors(blend: Blend, weights, samples=3000, longest=200):
    """The largest |count - w x N| over every prefix, and over every window of up to `longest` samples."""
    sources = np.array([blend.locate(i)[0] for i in range(samples)])
    prefix, window = 0.0, 0.0
    for s, w in enumerate(weights):
        counts = np.concatenate([[0], np.cumsum(sources == s)])
        prefix = max(prefix, np.abs(counts[1:] - w * np.arange(1, samples + 1)).max())
        for n in range(1, longest):
            window = max(window, np.abs(counts[n:] - counts[:-n] - w * n).max())
    return prefix, window


def test_proportions_are_exact():
    prefix, window = window_errors(Blend([0.7, 0.3]), [0.7, 0.3])
    assert prefix < 1 and window < 1, "two sources: every window within 1 of w x N"
    prefix, window = window_errors(Blend([0.5, 0.3, 0.2]), [0.5, 0.3, 0.2])
    assert prefix < 1 and window < 2
    weights = [0.101, 0.501, 0.101, 0.001, 0.761]  # a prefix passes 1 here (1.03): the docs say within 2
    prefix, window = window_errors(Blend(weights), [w / sum(weights) for w in weights], samples=6000)
    assert 1 < prefix < 2 and window < 2


def test_a_sample_is_located_the_same_way_by_a_fresh_blend_and_indices_cover_each_source_once():
    blend = Blend([0.6, 0.25, 0.15])
    located = [blend.locate(i) for i in range(1000)]
    assert located == [Blend([0.6, 0.25, 0.15]).locate(i) for i in range(1000)], "a pure function of the index"
    for source in range(3):
        within = [k for s, k in located if s == source]
        assert within == list(range(len(within))), "each source's rows in order, none skipped or repeated"
    assert list(blend.counts(1000)) == [sum(1 for s, _ in located if s == source) for source in range(3)]


def test_weights_that_cannot_blend_are_refused():
    with pytest.raises(MixtureError, match="positive"):
        Blend([0.5, 0.0])
    with pytest.raises(MixtureError, match="common denominator"):
        Blend([1 / 3, 1 / 7, 1 / 11, 0.123457])
    with pytest.raises(MixtureError, match=r"mixture weights \[1e-07\] are below a millionth of the total"):
        Blend([1e-7, 1])  # rounded to 0 at six decimals, its source was silently never drawn


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("mixture")
    lines = corpus["train"].read_text().splitlines(keepends=True)
    paths = []
    for name, part in (("code", lines[: len(lines) // 2]), ("docs", lines[len(lines) // 2 :])):
        (root / f"{name}.jsonl").write_text("".join(part))
        preprocess(str(corpus["tokenizer"]), [str(root / f"{name}.jsonl")], str(root / name), 128, 1)
        paths.append(root / name)
    return paths


def mixture_config(paths, **extra):
    return PretrainConfig(
        output_dir="unused", tokenizer_name_or_path="unused", train_mixture=[
            {"path": str(paths[0]), "weight": 0.7}, {"path": str(paths[1]), "weight": 0.3}],
        max_seq_length=128, per_device_train_batch_size=2, max_steps=20, **extra,
    )  # fmt: skip


def test_the_same_rows_on_any_world_size_and_an_exact_resume(two_sources):
    sources = [PackedRows(path) for path in two_sources]
    mixture = MixedRows(sources, [0.7, 0.3], True, 20 * 8)

    def steps(world, accumulation, count, state=None):
        config = mixture_config(two_sources, gradient_accumulation_steps=accumulation)
        ranks = [TrainData(mixture, config, None, rank, world) for rank in range(world)]
        if state is not None:
            for data in ranks:
                data.load_state_dict(state)
        out = [sorted(tuple(r) for data in ranks for r in torch.cat(data.take(accumulation)).tolist())
               for _ in range(count)]  # fmt: skip
        saved = ranks[0].state_dict()
        for data in ranks:
            data.close()
        return out, saved

    two, state = steps(2, 2, 3)  # 2 ranks x 2 micro-batches x 2 rows: global batch 8
    one, _ = steps(1, 4, 3)
    assert two == one
    continued, _ = steps(1, 4, 2, state)  # state saved by one rank of two, resumed on one process
    assert continued == steps(2, 2, 5)[0][3:]
    expected = [sources[s][k]["input_ids"].tolist() for s, k in (mixture.blend.locate(i) for i in range(24))]
    assert sorted(itertools.chain.from_iterable(two)) == sorted(map(tuple, expected))


def test_mixture_config_rules(two_sources):
    shape = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1}
    base = {"output_dir": "o", "tokenizer_name_or_path": "t", "model_config": shape, "max_steps": 10,
            "lr_scheduler_type": "cosine"}  # fmt: skip
    mixture = [{"path": str(two_sources[0]), "weight": 0.7}, {"path": str(two_sources[1]), "weight": 0.3}]
    with pytest.raises(ConfigError, match="train_files and train_mixture are both set"):
        config_from_dict({**base, "train_files": ["a.jsonl"], "train_mixture": mixture})
    with pytest.raises(ConfigError, match=r"train_mixture\[0\]: expected \{path: DIR, weight: w\}"):
        config_from_dict({**base, "train_mixture": [{"path": "a", "wieght": 1}]})
    with pytest.raises(ConfigError, match="mixture_exhausted"):
        config_from_dict({**base, "train_mixture": mixture, "mixture_exhausted": "loop"})
    assert config_from_dict({**base, "train_mixture": mixture}).train_mixture[1]["weight"] == 0.3
    twice = [mixture[0], {"path": str(two_sources[0]) + "/", "weight": 0.3}]
    with pytest.raises(ConfigError, match=r"train_mixture\[1\]\.path .* is train_mixture\[0\]'s directory again"):
        config_from_dict({**base, "train_mixture": twice})


def test_a_copy_of_a_source_under_another_path_is_refused(two_sources, tmp_path, corpus):
    import shutil

    from transformers import AutoTokenizer

    from recipes.training.train_data import open_mixture

    copy = tmp_path / "copy"
    shutil.copytree(two_sources[0], copy)
    config = mixture_config([two_sources[0], copy])
    config.tokenizer_name_or_path = str(corpus["tokenizer"])
    with pytest.raises(ConfigError, match=r"train_mixture\[1\]\.path .* holds the same data as train_mixture\[0\]"):
        open_mixture(config, AutoTokenizer.from_pretrained(corpus["tokenizer"]), 1)


def test_equal_blends_are_equal_on_resume_and_a_changed_blend_is_shown_whole():
    from recipes.training.resume import identity_changes

    def identity(*weights):
        return {"train_data": [{"preprocessed_manifest_sha256": f"{i}" * 64, "weight": w, "exhausted": "repeat"}
                               for i, w in enumerate(weights)]}  # fmt: skip

    assert identity_changes(identity(0.7, 0.3), identity(7, 3)) == []
    (change,) = identity_changes(identity(0.7, 0.3), identity(0.6, 0.4))
    assert '"weight": "7/10"' in change and '"weight": "3/5"' in change and "..." not in change


@pytest.mark.multiprocess
def test_a_two_source_mixture_trains_logs_its_shares_and_resumes_exactly(tmp_path, corpus, two_sources):
    mixture = f"[{{path: {two_sources[0]}, weight: 0.7}}, {{path: {two_sources[1]}, weight: 0.3}}]"
    args = tiny_overrides(corpus, tmp_path / "run", train_files="null", train_mixture=mixture, max_steps=8,
                          save_steps=4, logging_steps=1, eval_steps=100, warmup_steps=2)  # fmt: skip
    full = launch(REPO / "recipes/pretrain.py", args)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "train mixture:" in full.stderr
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "mixture_tokens" in r]
    last = records[-1]["mixture_tokens"]
    total = 8 * 32 * 128  # steps x global batch x tokens per row
    assert sum(last.values()) == total
    assert abs(last[str(two_sources[0])] - 0.7 * total) <= 128 and abs(last[str(two_sources[1])] - 0.3 * total) <= 128
    print("per-source token shares at step 8:", json.dumps({k: v / total for k, v in last.items()}))

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", resumed_dir, ignore=shutil.ignore_patterns("checkpoint-8", "final"))
    (resumed_dir / "latest").write_text("checkpoint-4\n")
    resumed = launch(REPO / "recipes/pretrain.py", [*args, "--output_dir", str(resumed_dir)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def losses(run_dir):
        return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}

    assert losses(resumed_dir) == losses(tmp_path / "run")


def test_a_source_that_runs_out_wraps_or_ends_the_mixture(two_sources):
    sources = [PackedRows(path) for path in two_sources]
    rows = [len(source) for source in sources]
    stopping = MixedRows(sources, [0.7, 0.3], repeat=False, samples_wanted=10 * sum(rows))
    drawn = stopping.drawn(len(stopping))
    assert any(d == r for d, r in zip(drawn, rows, strict=True)), "it ends when the first source is used up"
    assert all(d <= r for d, r in zip(drawn, rows, strict=True)) and len(stopping) < 10 * sum(rows)
    with pytest.raises(IndexError):
        stopping[len(stopping)]
    repeating = MixedRows(sources, [0.7, 0.3], repeat=True, samples_wanted=4 * sum(rows))
    epochs = [d / r for d, r in zip(repeating.drawn(len(repeating)), rows, strict=True)]
    assert len(repeating) == 4 * sum(rows) and max(epochs) > 1
    last = len(repeating) - 1
    source, within = repeating.blend.locate(last)
    assert torch.equal(repeating[last]["input_ids"], sources[source][within % rows[source]]["input_ids"]), "wrapped"


def test_an_empty_source_is_one_line_and_a_repeating_mixture_has_room_for_its_rollbacks(two_sources, tmp_path, corpus):
    """A source preprocessed to 0 rows (documents shorter than one row) was a division by zero, a traceback and exit
    1, which a scheduler requeues; a repeating mixture sized to max_steps alone ran out early after each loss-spike
    rollback, which skips the data since the checkpoint (END_OF_DATA before the learning rate had decayed)."""
    from transformers import AutoTokenizer

    from recipes.training.train_data import open_mixture

    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    (tmp_path / "short.jsonl").write_text('{"text": "too short for a row"}\n')
    preprocess(str(corpus["tokenizer"]), [str(tmp_path / "short.jsonl")], str(tmp_path / "empty"), 128, 1)
    config = mixture_config([two_sources[0], tmp_path / "empty"])
    config.tokenizer_name_or_path = str(corpus["tokenizer"])
    with pytest.raises(ConfigError, match=r"train_mixture\[1\]\.path .*empty holds no rows"):
        open_mixture(config, tokenizer, 1)
    spikes = {
        "loss_spike_factor": 3.0,
        "loss_spike_action": "rollback",
        "loss_spike_max_rollbacks": 2,
        "save_steps": 5,
        "mixture_exhausted": "repeat",
    }
    for action, steps in (("rollback", 20 + 2 * 5), ("log", 20)):  # max_steps + max_rollbacks x save_steps
        config = mixture_config(two_sources, **{**spikes, "loss_spike_action": action})
        config.tokenizer_name_or_path = str(corpus["tokenizer"])
        assert len(open_mixture(config, tokenizer, 1)) == steps * config.resolved_global_batch_size(1)
