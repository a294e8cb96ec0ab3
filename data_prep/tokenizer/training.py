"""Train a byte-level BPE tokenizer and save it as a Hugging Face fast tokenizer.

    python -m data_prep.train_tokenizer --input corpus.jsonl --vocab-size 16000 --output tokenizer/

Byte-level means every byte has a token, so no input is ever out of vocabulary. The saved
directory loads with `AutoTokenizer.from_pretrained` and has an EOS token, which packing puts
after every document. `--vocab-size` counts the special tokens, so `len(tokenizer)` equals it.

Exit codes (docs/run-safety.md): 0 done; 2 bad input, one line; 4 the output's disk is full (make room, then the
same command trains and saves again; nothing half-written is left).
"""

from __future__ import annotations

import collections
import itertools
import shutil
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from common.exit_codes import DISK_FULL, DONE, OneLineParser, disk_full, disk_full_line
from common.files import directory_problem
from common.lock import held_by_someone
from data_prep.reading.readers import CorruptFileError, InputError, check_inputs, iter_records
from data_prep.tokenizer.loading import tokenizer_pin

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def train_tokenizer(texts, vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )


def main(argv: list[str] | None = None) -> int:
    """Bad input and a full disk raise SystemExit (2, 4) after their one line, as argparse does."""
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="jsonl / parquet / txt files (optionally .gz)")
    parser.add_argument("--vocab-size", type=int, required=True, help="vocabulary size including special tokens")
    parser.add_argument("--output", required=True, help="directory to save the tokenizer in")
    parser.add_argument("--text-field", default="text", help="field holding the text in jsonl/parquet")
    parser.add_argument("--max-documents", type=int, default=None, help="train on the first N documents only")
    parser.add_argument("--overwrite", action="store_true", help="replace the tokenizer already in --output")
    args = parser.parse_args(argv)
    if args.vocab_size < 258:
        parser.error(f"--vocab-size {args.vocab_size} is too small: 256 byte tokens + 2 special tokens is the minimum")
    output = Path(args.output)
    try:  # files (no hub names: the readers take files), their formats and a parquet's column, before any work
        sources = check_inputs(args.input, args.text_field)
        check_output(output, args.overwrite)
    except (InputError, ValueError) as error:
        parser.error(str(error))
    counts: collections.Counter = collections.Counter()
    texts = itertools.chain.from_iterable(counted_texts(path, args.text_field, counts) for path in sources)
    if args.max_documents is not None:
        texts = itertools.islice(texts, args.max_documents)
    try:
        tokenizer = train_tokenizer(texts, args.vocab_size)
    except CorruptFileError as error:  # found while reading: a traceback before
        parser.error(f"--input: {error}")
    said = read_line(counts, args.text_field)
    if not counts["documents"]:  # a wrong --text-field gave a 258-token tokenizer, saved, exit 0
        parser.error(f"--input: no document was read ({said}); nothing was saved")
    print(said)
    if len(tokenizer) < args.vocab_size:
        print(f"warning: the corpus gave {len(tokenizer):,} tokens, fewer than --vocab-size {args.vocab_size:,} "
              "(too little text for that many merges)", file=sys.stderr)  # fmt: skip
    try:
        publish(tokenizer, output)
    except Exception as error:  # tokenizers' own writer raises a plain Exception, "... (os error 28)"
        full = disk_full(error)
        if full is None:
            raise
        said = disk_full_line(output, full, "it trains and saves again", what="the tokenizer")
        parser.exit(DISK_FULL, f"error: {said}\n")
    print(f"saved a {len(tokenizer)}-token byte-level BPE tokenizer to {args.output}")
    return DONE


def counted_texts(path, text_field: str, counts: collections.Counter):
    """The documents of `path`, counting them and each skipped record by its reason in `counts`."""
    for record in iter_records(path, text_field):
        counts["documents" if record.text is not None else record.skipped] += 1
        if record.text is not None:
            yield record.text


def read_line(counts: collections.Counter, text_field: str) -> str:
    skipped = ", ".join(f"{reason} {count:,}" for reason, count in sorted(counts.items()) if reason != "documents")
    hint = f"; is the text under another field than --text-field {text_field}?" if counts["missing_field"] else ""
    return f"read {counts['documents']:,} documents" + (f", skipped {skipped}{hint}" if skipped else "")


# What save_pretrained writes for a fast tokenizer, across transformers versions: --overwrite replaces a directory
# that holds only these, never a model, checkpoint or dataset directory whose tokenizer would no longer match it.
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.jinja"}  # fmt: skip


def check_output(output: Path, overwrite: bool) -> None:
    """Before training: the output is new or empty, or (with --overwrite) holds a tokenizer and nothing else.
    Checkpoints and preprocessed shards record the tokenizer they were made with; replacing it silently would
    make them disagree with it."""
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is a file; give a directory")
    problem = directory_problem(output)
    if problem:
        raise ValueError(f"--output {output} {problem}")
    present = sorted(entry.name for entry in output.iterdir()) if output.is_dir() else []
    if not present:
        return
    others = [name for name in present if name not in TOKENIZER_FILES]
    if others:
        raise ValueError(f"--output {output} holds other files ({', '.join(others[:3])}), not only a tokenizer; "
                         "choose a new directory")  # fmt: skip
    if not overwrite:
        raise ValueError(f"--output {output} already holds a tokenizer; pass --overwrite to replace it, or choose "
                         "a new directory")  # fmt: skip
    if held_by_someone(tokenizer_pin(output)):
        raise ValueError(f"--output {output} is the tokenizer of a training run that is running now (it holds "
                         f"{tokenizer_pin(output)}): replacing it would give that run's checkpoints another "
                         "vocabulary; train into a new directory")  # fmt: skip


def publish(tokenizer: PreTrainedTokenizerFast, output: Path) -> None:
    """Saved beside the output, then renamed into place: a kill leaves the old tokenizer or the new one whole; a
    failed save (a full disk) removes what it wrote."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging, retired = output.with_name(f".{output.name}.tmp"), output.with_name(f".{output.name}.old")
    for leftover in (staging, retired):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        tokenizer.save_pretrained(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if output.exists():
        output.rename(retired)
    staging.rename(output)
    shutil.rmtree(retired, ignore_errors=True)


if __name__ == "__main__":  # the same command by its module path
    raise SystemExit(main())
