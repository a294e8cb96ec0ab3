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
        tally["share_of_corpus"] = {"docs": (tally["docs_in"] - tally["docs_out"]) / corpus_docs,
                                    "bytes": (tally["bytes_in"] - tally["bytes_out"]) / corpus_bytes}  # fmt: skip
    last = steps[labels[-1]] if labels else read
    sizes = cluster_sizes(work / "minhash" / "clusters") if job.config.dedup.enabled else {}
    return {
        "inputs": list(job.files),
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


def render_markdown(report: dict) -> str:
    read, output = report["read"], report["output"]
    lines = [
        "# Cleaning report",
        "",
        f"{read['docs_out']:,} documents ({read['bytes_out'] / 1e6:,.1f} MB) read from {len(report['inputs'])} "
        f"file(s); {output['docs']:,} documents ({output['bytes'] / 1e6:,.1f} MB) kept in {len(output['shards'])} "
        "shard(s) under `data/`.",
        "",
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
        *summary_table(report),
    ]
