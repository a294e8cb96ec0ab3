"""The shuffled order of a preprocessed directory's rows (data_prep.packing.row_order): a permutation for every size,
drawn from the seed and the epoch, spread over the whole directory, and what a run trains with it."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from data_prep.packing.packed_dataset import PackedRows
from data_prep.packing.row_order import RowOrder
from data_prep.preprocessing.pipeline import preprocess
from data_prep.reading.readers import iter_texts


@pytest.mark.parametrize("num_rows", [*range(0, 70), 127, 128, 129, 1000, 4097, 65_536])
def test_every_size_gets_a_permutation(num_rows):
    order = RowOrder(num_rows, seed=42)
    for epoch in (0, 1):
        assert sorted(order(position, epoch) for position in range(num_rows)) == list(range(num_rows))


def test_the_order_is_drawn_from_seed_and_epoch_and_spreads_over_the_directory():
    rows = 100_003
    order = RowOrder(rows, seed=42)
    first = [order(position) for position in range(2000)]
    assert first == [RowOrder(rows, seed=42)(position) for position in range(2000)], "the same in any process"
    assert first != [order(position, epoch=1) for position in range(2000)], "another permutation each epoch"
    assert first != [RowOrder(rows, seed=43)(position) for position in range(2000)]
    gaps = np.abs(np.diff(first)) / rows
    assert 0.28 < gaps.mean() < 0.39, "neighbours land a third of the directory apart, as for a uniform draw"
    deciles = np.bincount(np.array(first) * 10 // rows, minlength=10)
    assert deciles.min() > 150, f"the first 2,000 positions draw from every tenth of the directory: {deciles}"
    with pytest.raises(IndexError):
        order(rows)


def test_a_shuffled_directory_gives_every_row_once_per_epoch_and_corpus_order_is_unchanged(tmp_path, corpus):
    out = tmp_path / "packed"
    preprocess(str(corpus["tokenizer"]), [str(corpus["train"])], str(out), 32, 1, rows_per_shard=300)
    plain = PackedRows(out)
    stored = [plain[index]["input_ids"].tolist() for index in range(len(plain))]
    shuffled = PackedRows(out).shuffle(seed=7)
    for epoch in (0, 1):
        shuffled.epoch = epoch
        rows = [shuffled[index]["input_ids"].tolist() for index in range(len(shuffled))]
        assert sorted(rows) == sorted(stored) and rows != stored
    assert [shuffled.at(index, 0)["input_ids"].tolist() for index in range(5)] != rows[:5]


def test_the_trained_order_is_shuffled_each_epoch_and_a_seek_continues_it(tmp_path, corpus):
    """What TrainData hands the loop from a preprocessed directory: not corpus order, every row once per epoch, another
    order in the next epoch, and a position restored mid-epoch continues with the very batches an uninterrupted read
    gives (the data position is still the rows consumed)."""
    from transformers import AutoTokenizer

    from recipes.config import load_config
    from recipes.training.train_data import TrainData, open_train_source
    from tests.conftest import TINY_RECIPE

    out, source = tmp_path / "packed", tmp_path / "some.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in list(iter_texts(corpus["train"]))[:60]))
    preprocess(str(corpus["tokenizer"]), [str(source)], str(out), 32, 1, rows_per_shard=300)
    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    overrides = ["--train_files", str(out), "--tokenizer_name_or_path", str(corpus["tokenizer"]), "--max_seq_length",
                 "32", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                 "--global_batch_size", "null", "--dataloader_num_workers", "0", "--num_train_epochs", "2"]  # fmt: skip

    def data(*more):
        config = load_config(TINY_RECIPE, [*overrides, *more])
        return TrainData(open_train_source(config, tokenizer, 1), config, tokenizer, rank=0, world=1)

    def epoch_rows(reader):
        return [row for _ in range(reader.steps_per_epoch) for row in reader.take(1)[0].tolist()]

    stored = [PackedRows(out)[index]["input_ids"].tolist() for index in range(len(PackedRows(out)))]
    corpus_order = data("--shuffle_train_rows", "false")
    assert epoch_rows(corpus_order) == stored[: len(epoch_rows(data("--shuffle_train_rows", "false")))]
    reader = data()
    first, second = epoch_rows(reader), epoch_rows(reader)
    whole = len(first)
    assert first != stored[:whole] and second != first
    assert not Counter(map(tuple, first)) - Counter(map(tuple, stored)), "rows of the directory, none twice"
    resumed = data()
    resumed.load_state_dict({"kind": "preprocessed", "per_rank": [{"epoch": 1, "rows_consumed": 40}],
                             "global_rows_consumed": 40})  # fmt: skip
    assert [row for _ in range(3) for row in resumed.take(1)[0].tolist()] == second[40:52]
    assert whole >= 52
    assert epoch_rows(data("--data_seed", "7")) != first
    with_workers = data("--dataloader_num_workers", "2")  # the epoch reaches the forked workers
    assert epoch_rows(with_workers) == first and epoch_rows(with_workers) == second
    with_workers.close()


def test_a_checkpoint_from_before_the_order_was_recorded_is_continued_only_in_corpus_order():
    from recipes.training.resume import identity_changes

    saved = {"text_field": "text"}  # no train_order: written in corpus order
    assert identity_changes(saved, {"text_field": "text", "train_order": {"shuffled": False}}) == []
    changes = identity_changes(saved, {"text_field": "text", "train_order": {"shuffled": True, "data_seed": 42}})
    assert changes == [
        "train_order.data_seed: null -> 42 (shuffle_train_rows / data_seed, or seed when data_seed is null (the order "
        "of the rows))",
        "train_order.shuffled: false -> true (shuffle_train_rows / data_seed, or seed when data_seed is null (the "
        "order of the rows))",
    ]
