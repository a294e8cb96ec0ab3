"""What a preprocessed corpus holds, for the person deciding whether to train on it: `data_report.md` and
`data_report.png` beside the manifest.

Document lengths are kept as a histogram with BINS_PER_OCTAVE log-spaced bins (a billion documents take the same
few kilobytes as a thousand), so the percentiles are those of the bins: exact to within one bin, about 4 %.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from data_prep.quality.cleaning.report import cleaning_section, find_clean_report

BINS_PER_OCTAVE = 16
NUM_BINS = 32 * BINS_PER_OCTAVE  # lengths up to 2^32 tokens
SHORT_DOCUMENT_TOKENS = 16  # a document this short is usually a boilerplate fragment, not text to learn from
PERCENTILES = (1, 10, 50, 90, 99)
REPORT_MD = "data_report.md"
REPORT_PNG = "data_report.png"


def length_bin(tokens: int) -> int:
    return min(NUM_BINS - 1, int(math.log2(max(tokens, 1)) * BINS_PER_OCTAVE))


def bin_floor(index: int) -> float:
    return 2 ** (index / BINS_PER_OCTAVE)


@dataclass
class CorpusStats:
    """Counts over the kept documents, per input and overall; JSON-serializable (saved with the progress)."""

    documents_per_input: list = field(default_factory=list)
    tokens_per_input: list = field(default_factory=list)  # document tokens, without EOS
    length_histogram: list = field(default_factory=lambda: [0] * NUM_BINS)
    chars: int = 0
    utf8_bytes: int = 0
    replacement_chars: int = 0
    short_documents: int = 0

    def add(self, kept) -> None:
        """Count the kept documents (data_prep.quality.filters.Kept)."""
        for document in kept:
            while len(self.documents_per_input) <= document.file_index:
                self.documents_per_input.append(0)
                self.tokens_per_input.append(0)
            self.documents_per_input[document.file_index] += 1
            self.tokens_per_input[document.file_index] += document.tokens
            self.length_histogram[length_bin(document.tokens)] += 1
            self.chars += document.chars
            self.utf8_bytes += document.utf8_bytes
            self.replacement_chars += document.replacement_chars
            self.short_documents += document.tokens < SHORT_DOCUMENT_TOKENS

    def merged(self, other: CorpusStats, inputs: int | None = None) -> CorpusStats:
        """This corpus, read from `inputs` files, followed by another (its inputs after these). The per-input lists
        grow only up to the last file that kept a document: padded to `inputs` first, or a later part's counts
        were put against this part's files."""
        padding = max(0, (inputs or 0) - len(self.documents_per_input))
        return CorpusStats(
            self.documents_per_input + [0] * padding + other.documents_per_input,
            self.tokens_per_input + [0] * padding + other.tokens_per_input,
            [a + b for a, b in zip(self.length_histogram, other.length_histogram, strict=True)],
            self.chars + other.chars,
            self.utf8_bytes + other.utf8_bytes,
            self.replacement_chars + other.replacement_chars,
            self.short_documents + other.short_documents,
        )

    def percentiles(self) -> dict[int, float]:
        counts = np.asarray(self.length_histogram)
        total = counts.sum()
        if not total:
            return {p: 0.0 for p in PERCENTILES}
        cumulative = np.cumsum(counts)
        return {p: bin_floor(int(np.searchsorted(cumulative, p / 100 * total))) for p in PERCENTILES}

    def to_dict(self) -> dict:
        return asdict(self)


def summary(manifest: dict, stats: CorpusStats) -> dict:
    """The report's numbers (also written to the manifest under `report`)."""
    documents = sum(stats.documents_per_input)
    tokens = sum(stats.tokens_per_input)
    return {
        "documents": documents,
        "document_tokens": tokens,
        "length_percentiles_tokens": {f"p{p}": round(v, 1) for p, v in stats.percentiles().items()},
        "replacement_char_share": stats.replacement_chars / max(stats.chars, 1),
        "short_document_share": stats.short_documents / max(documents, 1),
        "short_document_tokens": SHORT_DOCUMENT_TOKENS,
        "tokens_per_byte": tokens / max(stats.utf8_bytes, 1),
        "contaminated": manifest["skipped"].get("contaminated", 0),
        "duplicate": manifest["skipped"].get("duplicate", 0),
    }


def render_markdown(manifest: dict, stats: CorpusStats, inputs: list[str]) -> str:
    numbers = summary(manifest, stats)
    lines = [
        "# Data report",
        "",
        f"{numbers['documents']:,} documents, {numbers['document_tokens']:,} tokens "
        f"({manifest['num_sequences']:,} rows of {manifest['seq_len']}), tokenizer "
        f"`{manifest['tokenizer'].get('name')}`.",
        "",
        "| input | documents | tokens |",
        "|---|---:|---:|",
    ]
    for index, path in enumerate(inputs):  # an input with no document kept shows as 0, not as missing
        docs = stats.documents_per_input[index] if index < len(stats.documents_per_input) else 0
        tokens = stats.tokens_per_input[index] if index < len(stats.tokens_per_input) else 0
        lines.append(f"| `{path}` | {docs:,} | {tokens:,} |")
    percentiles = " · ".join(f"{k} {v:,.0f}" for k, v in numbers["length_percentiles_tokens"].items())
    skipped = ", ".join(f"{reason} {count:,}" for reason, count in manifest["skipped"].items() if count) or "none"
    lines += [
        "",
        f"- document length in tokens (within ~4 %): {percentiles}",
        f"- replacement characters (U+FFFD): {numbers['replacement_char_share']:.4%} of characters",
        f"- documents under {SHORT_DOCUMENT_TOKENS} tokens: {numbers['short_document_share']:.2%}",
        f"- tokenizer efficiency: {numbers['tokens_per_byte']:.3f} tokens per UTF-8 byte "
        f"({1 / max(numbers['tokens_per_byte'], 1e-9):.2f} bytes per token)",
        f"- dropped: {numbers['contaminated']:,} contaminated, {numbers['duplicate']:,} duplicate",
        f"- all skipped records: {skipped}",
    ]
    for reason, examples in manifest.get("skipped_examples", {}).items():
        lines.append(f"  - {reason}: " + "; ".join(f"`{e}`" for e in examples))
    cleaned = find_clean_report(inputs)
    if cleaned:
        lines += cleaning_section(cleaned)
    lines += ["", f"![document length histogram]({REPORT_PNG})", ""]
    return "\n".join(lines)


def render_png(stats: CorpusStats, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a cluster node
    import matplotlib.pyplot as plt

    counts = np.asarray(stats.length_histogram)
    used = np.nonzero(counts)[0]
    figure, axis = plt.subplots(figsize=(7, 3.2), dpi=100)
    if len(used):
        low, high = used[0], used[-1] + 1
        edges = [bin_floor(i) for i in range(low, high + 1)]
        axis.stairs(counts[low:high], edges, fill=True)
        axis.set_xscale("log")
    axis.set_xlabel("document length (tokens)")
    axis.set_ylabel("documents")
    axis.set_title("Document lengths")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def write_report(out: Path, manifest: dict, stats: CorpusStats, inputs: list[str]) -> None:
    from common.files import atomic_write_text

    render_png(stats, out / REPORT_PNG)
    atomic_write_text(out / REPORT_MD, render_markdown(manifest, stats, inputs))
