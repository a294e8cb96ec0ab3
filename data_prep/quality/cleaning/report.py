"""What the cleaning stage did, for the person deciding whether to train on its output: `clean_report.json` and
`clean_report.md` beside `data/`. Built from the per-task audit files of every step and the MinHash cluster sizes;
`data_prep.preprocess` puts its summary (`cleaning_section`) into the data report of a corpus made from it, which is
why nothing here imports datatrove."""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

from common.files import atomic_write_text

EXAMPLES_PER_FILTER = 5
READ_STEP = "read"  # the corpus reader's audit folder
NEAR_DUPLICATES = "near_duplicates"  # the MinHash filter's audit folder and removal reason
REPORT_JSON = "clean_report.json"
REPORT_MD = "clean_report.md"
EXAMPLE_MD_CHARS = 300
# A warning (stderr, and `warnings` in the report) when the run removes more than this share of the bytes it read, or
# one step more than STEP_WARNING of the bytes it saw: the web preset removed 90 % of real technical documentation
# with exit 0 and no word (docs/data-cleaning.md, "Presets").
RUN_WARNING = 0.5
STEP_WARNING = 1 / 3
# The argument that decides each removal reason: the key a warning says to loosen.
REASON_KEYS = {
    "unknown_characters": "max_share",
    "dup_para_frac": "dup_para_frac",
    "dup_para_char_frac": "dup_para_char_frac",
    "dup_line_frac": "dup_line_frac",
    "dup_line_char_frac": "dup_line_char_frac",
    "gopher_short_doc": "min_doc_words",
    "gopher_long_doc": "max_doc_words",
    "gopher_below_avg_threshold": "min_avg_word_length",
    "gopher_above_avg_threshold": "max_avg_word_length",
    "gopher_too_many_hashes": "max_symbol_word_ratio",
    "gopher_too_many_ellipsis": "max_symbol_word_ratio",
    "gopher_too_many_bullets": "max_bullet_lines_ratio",
    "gopher_too_many_end_ellipsis": "max_ellipsis_lines_ratio",
    "gopher_below_alpha_threshold": "max_non_alpha_words_ratio",
    "gopher_enough_stop_words": "min_stop_words",
    "curly_bracket": "filter_curly_bracket",
    "lorem_ipsum": "filter_lorem_ipsum",
    "too_few_sentences": "min_num_sentences",
    "line_punct_ratio": "line_punct_thr",
    "short_line_ratio": "short_line_thr",
    "char_dup_ratio": "char_duplicates_ratio",
    "list_ratio": "new_line_ratio",
}
LINES_CUT = "lines cut from kept documents"  # C4's filter removes lines (and their indentation) from what it keeps


def merge_audits(work: Path, step: str) -> dict:
    """One step's tallies summed over its tasks (examples: the first ones in rank order)."""
    total = {"docs_in": 0, "bytes_in": 0, "docs_out": 0, "bytes_out": 0, "removed": {}, "examples": [],
             "skipped": Counter(), "skipped_examples": {}, "corrupt_files": []}  # fmt: skip
    for path in sorted((work / "audit" / step).glob("*.json")):
        tally = json.loads(path.read_text())
        for key in ("docs_in", "bytes_in", "docs_out", "bytes_out"):
            total[key] += tally[key]
        for reason, entry in tally["removed"].items():
            merged = total["removed"].setdefault(reason, {"docs": 0, "bytes": 0})
            merged["docs"] += entry["docs"]
            merged["bytes"] += entry["bytes"]
        total["examples"] += tally["examples"][: EXAMPLES_PER_FILTER - len(total["examples"])]
        total["skipped"].update(tally["skipped"])
        for reason, examples in tally["skipped_examples"].items():
            kept = total["skipped_examples"].setdefault(reason, [])
            kept += examples[: EXAMPLES_PER_FILTER - len(kept)]
        total["corrupt_files"] += tally["corrupt_files"]
    total["skipped"] = dict(total["skipped"])
    return total


def cluster_sizes(clusters: Path) -> dict[int, int]:
    """{cluster size: number of clusters} from MinhashDedupCluster's `.sizes` files (one (doc, size) pair of uint32
    per document in a cluster, so a cluster of n documents appears n times)."""
    members: Counter = Counter()
    for path in sorted(clusters.glob("*.sizes")):
        data = path.read_bytes()
        for _, size in struct.iter_unpack("<2I", data):
            members[size] += 1
    return {size: count // size for size, count in sorted(members.items())}


def build_report(job, shards: list[str]) -> dict:
    work = job.work
    read = merge_audits(work, READ_STEP)
    labels = [choice.name for choice in job.config.filters] + ([NEAR_DUPLICATES] if job.config.dedup.enabled else [])
    steps = {label: merge_audits(work, label) for label in labels}
    corpus_docs, corpus_bytes = max(read["docs_out"], 1), max(read["bytes_out"], 1)
    for tally in steps.values():  # bytes: C4's filter also cuts lines out of the documents it keeps
        tally["bytes_cut_from_kept"] = bytes_cut_from_kept(tally)
        tally["share_of_corpus"] = {"docs": (tally["docs_in"] - tally["docs_out"]) / corpus_docs,
                                    "bytes": (tally["bytes_in"] - tally["bytes_out"]) / corpus_bytes}  # fmt: skip
    last = steps[labels[-1]] if labels else read
    sizes = cluster_sizes(work / "minhash" / "clusters") if job.config.dedup.enabled else {}
    report = {
        "inputs": list(job.files),
        "text_field": job.text_field,
        "preset": job.preset,
        "config": job.config.to_dict(),
        "tasks": job.tasks,
        "read": {key: read[key] for key in ("docs_out", "bytes_out", "skipped", "skipped_examples", "corrupt_files")},
        "steps": steps,
        "duplicate_clusters": {
            "clusters": sum(sizes.values()),
            "documents": sum(size * count for size, count in sizes.items()),
            "by_size": {str(size): count for size, count in sizes.items()},
        },
        "output": {"docs": last["docs_out"], "bytes": last["bytes_out"], "shards": shards},
    }
    empty = no_document_kept(report)
    report["warnings"] = [empty] * bool(empty) + clean_warnings(report)
    return report


def bytes_cut_from_kept(tally: dict) -> int:
    """Bytes a step took out of the documents it kept (C4's filter drops short, javascript and policy lines, and
    each line's indentation): neither a removed document's nor in the output."""
    return tally["bytes_in"] - tally["bytes_out"] - sum(entry["bytes"] for entry in tally["removed"].values())


def removed_bytes_by_reason(tally: dict) -> dict[str, int]:
    """Bytes a step removed, by reason; what it cut from the documents it kept under LINES_CUT."""
    removed = {reason: entry["bytes"] for reason, entry in tally["removed"].items()}
    cut = bytes_cut_from_kept(tally)
    return removed | ({LINES_CUT: cut} if cut > 0 else {})


def no_document_kept(report: dict) -> str | None:
    """Why the output holds no document (the command's error, exit 2, and the report's first warning); None when it
    holds one. An empty output is almost surely a mistake: the wrong files, --text-field or thresholds."""
    if report["output"]["docs"]:
        return None
    read = report["read"]
    if not read["docs_out"]:
        skipped = read["skipped"]
        detail = f"{len(report['inputs'])} file(s), {sum(skipped.values()):,} records skipped"
        if skipped:
            most = max(skipped, key=skipped.get)
            example = (read["skipped_examples"].get(most) or ["?"])[0]
            detail += f": {', '.join(f'{reason} {count:,}' for reason, count in skipped.items())}; e.g. {example}"
        return (f"the output holds no document: the input yielded none ({detail}); check the files' format and "
                f"--text-field {report.get('text_field', 'text')}")  # fmt: skip
    removed_docs = {step: tally["docs_in"] - tally["docs_out"] for step, tally in report["steps"].items()}
    step = max(removed_docs, key=removed_docs.get)
    reasons = report["steps"][step]["removed"]
    reason = max(reasons, key=lambda name: reasons[name]["docs"]) if reasons else "?"
    return (
        f"the output holds no document: all {read['docs_out']:,} documents read were removed, most by {step} "
        f"({removed_docs[step]:,}, most for {reason}); {_fix(report.get('preset'), step, reason)}"
    )


def _key_of(reason: str) -> str | None:
    if reason.startswith("top_") and reason.endswith("_gram"):
        return "top_n_grams"
    if reason.startswith("duplicated_") and reason.endswith("_n_grams"):
        return "dup_n_grams"
    if reason == LINES_CUT:
        return "min_words_per_line"
    return REASON_KEYS.get(reason)


def _fix(preset: str | None, step: str, reason: str) -> str:
    """What to do about a step that removed too much."""
    if step == NEAR_DUPLICATES:
        return ("the input holds that many near-copies (the clusters are in the report); if they are wanted, set "
                "dedup.enabled: false in a --config")  # fmt: skip
    key = _key_of(reason)
    loosen = f"filters.{step}.{key}" if key else f"filters.{step}"
    if preset == "web":
        return f"for books, documentation or prose with code use --preset curated; or loosen {loosen} in a --config"
    if preset == "curated":
        return f"loosen {loosen} in a copy of data_prep/quality/cleaning/curated.yaml passed as --config"
    return f"loosen {loosen} in your --config, or try --preset curated for books and documentation"


def clean_warnings(report: dict) -> list[str]:
    """A line for the run, if it removed over RUN_WARNING of the bytes read, and for each step that removed over
    STEP_WARNING of the bytes it saw: its most common reason (by bytes), the share, and the fix."""
    found, preset = [], report.get("preset")
    worst = {}
    for step, tally in report["steps"].items():
        by_reason = removed_bytes_by_reason(tally)
        if not by_reason or not tally["bytes_in"]:
            continue
        reason, reason_bytes = max(by_reason.items(), key=lambda item: item[1])
        removed = tally["bytes_in"] - tally["bytes_out"]
        worst[step] = (removed, reason)
        if removed > STEP_WARNING * tally["bytes_in"]:
            found.append(f"{step} removed {removed / tally['bytes_in']:.1%} of the bytes it saw ({_mb(removed)} of "
                         f"{_mb(tally['bytes_in'])}), most for {reason} ({reason_bytes / removed:.0%} of them); "
                         f"{_fix(preset, step, reason)}")  # fmt: skip
    read = report["read"]["bytes_out"]
    removed = read - report["output"]["bytes"]
    if read and removed > RUN_WARNING * read and worst:
        step, (step_removed, reason) = max(worst.items(), key=lambda item: item[1][0])
        found.insert(0, f"the run removed {removed / read:.1%} of the bytes read ({_mb(removed)} of {_mb(read)}), "
                        f"most by {step} ({_mb(step_removed)}, most for {reason}); "
                        f"{_fix(preset, step, reason)}")  # fmt: skip
    return found


def _mb(count: int) -> str:
    return f"{count / 1e6:,.2f} MB"


def render_markdown(report: dict) -> str:
    read, output = report["read"], report["output"]
    lines = [
        "# Cleaning report",
        "",
        f"{read['docs_out']:,} documents ({read['bytes_out'] / 1e6:,.1f} MB) read from {len(report['inputs'])} "
        f"file(s); {output['docs']:,} documents ({output['bytes'] / 1e6:,.1f} MB) kept in {len(output['shards'])} "
        "shard(s) under `data/`.",
        "",
        *(f"**Warning:** {warning}" + "\n" for warning in report.get("warnings", [])),
        *summary_table(report),
        "",
    ]
    skipped = ", ".join(f"{reason} {count:,}" for reason, count in read["skipped"].items()) or "none"
    lines += [f"Records that are not documents (skipped, as preprocessing does): {skipped}."]
    lines += [f"- corrupt file (what was read of it kept): {error}" for error in read["corrupt_files"]]
    clusters = report["duplicate_clusters"]
    if clusters["clusters"]:
        by_size = ", ".join(f"{count:,} of {size}" for size, count in clusters["by_size"].items())
        lines += ["", f"Near-duplicate clusters: {clusters['clusters']:,} holding {clusters['documents']:,} documents, "
                      f"one kept from each (clusters by size: {by_size})."]  # fmt: skip
    for label, tally in report["steps"].items():
        reasons = ", ".join(f"{reason} {entry['docs']:,}" for reason, entry in tally["removed"].items()) or "none"
        lines += ["", f"## {label}", "", f"Removed by reason: {reasons}.", ""]
        for example in tally["examples"]:
            text = example["text"][:EXAMPLE_MD_CHARS].replace("```", "'''")
            lines += [f"- `{example['id']}` ({example['reason']}):", "", "  ```", *("  " + line for line in
                      text.splitlines()[:8]), "  ```"]  # fmt: skip
    return "\n".join(lines) + "\n"


def summary_table(report: dict) -> list[str]:
    """Documents and bytes in and out per step, and the share of the corpus each step removed."""
    lines = ["| step | docs in | docs out | MB in | MB out | share of corpus removed (docs / bytes) |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for label, tally in report["steps"].items():
        share = tally["share_of_corpus"]
        lines.append(f"| {label} | {tally['docs_in']:,} | {tally['docs_out']:,} | {tally['bytes_in'] / 1e6:,.2f} | "
                     f"{tally['bytes_out'] / 1e6:,.2f} | {share['docs']:.2%} / {share['bytes']:.2%} |")  # fmt: skip
    return lines


def write_clean_report(job, shards: list[str]) -> dict:
    report = build_report(job, shards)
    out = Path(job.out)
    atomic_write_text(out / REPORT_MD, render_markdown(report))
    atomic_write_text(out / REPORT_JSON, json.dumps(report, indent=2))  # last: its presence means "complete"
    return report


def find_clean_report(inputs: list[str]) -> Path | None:
    """The cleaning report of the cleaned corpus these input files come from (`<out>/data/*.jsonl.zst`), if any."""
    for source in inputs:
        candidate = Path(source).resolve().parent.parent / REPORT_JSON
        if Path(source).resolve().parent.name == "data" and candidate.is_file():
            return candidate
    return None


def cleaning_section(report_path: Path) -> list[str]:
    """The data report's section on the cleaning that made its inputs."""
    report = json.loads(report_path.read_text())
    read, output = report["read"], report["output"]
    return [
        "",
        "## Cleaning",
        "",
        f"The inputs were cleaned by `data_prep.clean`: {read['docs_out']:,} documents in, {output['docs']:,} out. "
        f"Full report: [{REPORT_MD}]({report_path.with_name(REPORT_MD).as_uri()}).",
        "",
        *(f"**Warning:** {warning}" + "\n" for warning in report.get("warnings", [])),
        *summary_table(report),
    ]
