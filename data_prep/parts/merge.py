"""One preprocessed directory from the parts of a preprocessing spread over machines.

    python -m data_prep.preprocess ... --num-parts K --part I --output parts/part-I     (one per machine / array task)
    python -m data_prep.merge parts/part-* --output DIR

DIR is an ordinary preprocessed directory (training reads it; `datasets.load_dataset(DIR)` opens it): the parts'
shards in part order (hard links where the file system allows, else copies, each checked against its part's
sha256 on the way), one manifest whose counts and data report cover all parts, and `merged_from` naming them.

What differs from one machine: each part packs its own documents, so each drops its own last partial row (fewer
than seq-len tokens), and a row never joins the end of one part to the start of the next. The documents and their
tokens are exactly those of a single run. Dedup (--dedup) is per part: a document repeated in two parts is kept
twice; the parts split the corpus by input file, so this matters only for copies across files of different parts.

Exit codes (docs/run-safety.md): 0 done; 2 bad input, one line; 4 the output's disk is full (make room, then the
same command merges again). It has no worker processes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from common.exit_codes import BAD_INPUT, DISK_FULL, DONE, OneLineParser, disk_full, disk_full_line
from common.files import (
    atomic_write_text,
    directory_problem,
    fingerprint_change,
    fsync_if_supported,
    sha256_of,
    sync_tree,
)
from common.lock import LOCK_FILE, DirectoryLock, LockedError
from data_prep.packing.format import (
    EXAMPLES_PER_REASON,
    MANIFEST,
    SHARD_DIR,
    SPECIAL_TOKENS_IN_TEXT,
    is_shard_file,
    shard_name,
)
from data_prep.preprocessing.report import CorpusStats, summary, write_report

MERGING = ".merging"  # written before a merge places its first shard, removed after its manifest


class MergeError(ValueError):
    """Parts that cannot be merged, or an output that cannot be written; the message names which and why."""

    exit_code = BAD_INPUT


class OutputFull(MergeError):
    """The output's filesystem is full or over quota: make room, then the same command merges again."""

    exit_code = DISK_FULL


def read_part_manifest(path: Path) -> dict:
    """A part's manifest, refused in one line when it is absent, damaged, or not a part's (another tool's
    manifest.json: a checkpoint's, a whole preprocessing's)."""
    if not (path / MANIFEST).is_file():
        raise MergeError(f"{path}: no {MANIFEST}, so this part is not complete; run its preprocessing command "
                         "again (it continues where it stopped)")  # fmt: skip
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        part = manifest["settings"]["part"]
        shards_listed = all(isinstance(shard["path"], str) for shard in manifest["shards"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        why = f"not valid JSON: {error}" if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
        raise MergeError(f"{path / MANIFEST} is not a preprocessing part's manifest ({why}); name the --output "
                         "directories of python -m data_prep.preprocess --num-parts K --part I") from None  # fmt: skip
    if not part or not shards_listed:
        raise MergeError(f"{path} was not made with --num-parts/--part; only parts of one run can be merged")
    return manifest


def read_parts(directories: list[str]) -> list[tuple[Path, dict]]:
    """The parts' manifests in part order, after checking that they are the complete, matching set."""
    parts = [(Path(directory), read_part_manifest(Path(directory))) for directory in directories]
    parts.sort(key=lambda part: part[1]["settings"]["part"]["index"])
    first = parts[0][1]["settings"]
    count = first["part"]["count"]
    indices = [manifest["settings"]["part"]["index"] for _, manifest in parts]
    if indices != list(range(count)):
        missing = sorted(set(range(count)) - set(indices))
        repeated = sorted({i for i in indices if indices.count(i) > 1})
        raise MergeError(f"the run has {count} parts; missing part(s) {missing}, repeated part(s) {repeated}")
    for path, manifest in parts:
        settings = manifest["settings"]
        for key in sorted(set(first) | set(settings)):
            mine, theirs = settings.get(key), first.get(key)
            if key in ("inputs", "input_fingerprints") or (key == "part" and mine["all_inputs"] == theirs[
                    "all_inputs"] and mine["count"] == theirs["count"]):  # fmt: skip
                continue
            if mine != theirs:
                raise MergeError(f"{path} was made with another {key} than {parts[0][0]}: parts of one run share "
                                 "every setting but --part")  # fmt: skip
    check_coverage(parts)
    return parts


def check_coverage(parts: list[tuple[Path, dict]]) -> None:
    """The parts together read every input file exactly once, all split the inputs by the same sizes, and each
    file is still what its part read. A file still being copied while the parts started once went to two parts
    (each split by the size it saw) and was merged twice."""
    every = [str(Path(source).resolve()) for source in parts[0][1]["settings"]["part"]["all_inputs"]]
    readers: dict[str, list[int]] = {source: [] for source in every}
    for path, manifest in parts:
        index = manifest["settings"]["part"]["index"]
        for source in manifest["settings"]["inputs"]:
            if source not in readers:
                raise MergeError(f"{path} (part {index}) read {source}, which is not among the run's inputs")
            readers[source].append(index)
    sizes = {}  # input -> {split size: parts that saw it}
    for _, manifest in parts:
        split_bytes = manifest["settings"]["part"].get("split_bytes")  # parts made before it was recorded: None
        for source, size in zip(every, split_bytes or [], strict=False):
            sizes.setdefault(source, {}).setdefault(size, []).append(manifest["settings"]["part"]["index"])
    for source, seen in readers.items():
        if len(seen) == 1:
            continue
        split = next((by_size for by_size in (sizes.get(source),) if by_size and len(by_size) > 1), None)
        why = "" if split is None else " (the file changed between their starts: " + ", ".join(
            f"part(s) {parts_} saw {size:,} bytes" for size, parts_ in split.items()) + ")"  # fmt: skip
        if not seen:
            raise MergeError(f"{source} was read by no part{why}: preprocess the parts again once the inputs are "
                             "final, each into a new directory")  # fmt: skip
        raise MergeError(f"{source} was read by parts {seen}: its documents would be merged twice{why}. Preprocess "
                         "the parts again once the inputs are final, each into a new directory")  # fmt: skip
    for source, by_size in sizes.items():
        if len(by_size) > 1:
            said = ", ".join(f"part(s) {parts_} saw {size:,} bytes" for size, parts_ in by_size.items())
            raise MergeError(f"the parts split the inputs by different sizes of {source} ({said}): it changed "
                             "between their starts; preprocess the parts again once the inputs are final")  # fmt: skip
    for path, manifest in parts:
        recorded = manifest["settings"].get("input_fingerprints") or []
        for source, before in zip(manifest["settings"]["inputs"], recorded, strict=False):
            change = fingerprint_change(source, before) if Path(source).exists() else None
            if change:
                index = manifest["settings"]["part"]["index"]
                raise MergeError(f"{source} changed since part {index} ({path}) read it: {change}; preprocess that "
                                 "part again into a new directory")  # fmt: skip


def merge(directories: list[str], output: str, log=print) -> dict:
    if not directories:
        raise MergeError("name the part directories to merge")
    parts = read_parts(directories)
    out = Path(output)
    problem = directory_problem(out)
    if problem:
        raise MergeError(f"--output {out} {problem}")
    try:
        return _merge(parts, out, log)
    except OSError as error:
        full = disk_full(error)
        if full is None:
            raise
        then = "it merges again from the start (what it wrote is replaced)"
        raise OutputFull(disk_full_line(out, full, then)) from None


def _merge(parts: list[tuple[Path, dict]], out: Path, log) -> dict:
    try:
        lock = DirectoryLock(out, "merge").acquire()
    except LockedError as error:
        raise MergeError(f"--output {error}") from None
    try:
        leftovers = [entry for entry in out.iterdir() if entry.name != LOCK_FILE]
        if leftovers and not unfinished_merge(out):
            raise MergeError(f"--output {out} is not empty; choose a new directory")
        for entry in leftovers:  # what a merge that failed or was killed wrote before its manifest: started again
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        atomic_write_text(out / MERGING, json.dumps([str(path) for path, _ in parts]))  # before any shard
        shards = []
        for path, manifest in parts:
            for shard in manifest["shards"]:
                target = out / shard_name(len(shards))
                _place(path / shard["path"], target, shard["sha256"])
                shards.append({**shard, "path": shard_name(len(shards))})
            log(f"{path}: {len(manifest['shards'])} shard(s), {manifest['num_documents']:,} documents")
        merged = merged_manifest([manifest for _, manifest in parts], shards, [str(path) for path, _ in parts])
        stats = CorpusStats(**merged["report"]["stats"])
        write_report(out, merged, stats, merged["settings"]["inputs"])
        sync_tree(out)  # every shard's name on storage before the manifest vouches for it
        atomic_write_text(out / MANIFEST, json.dumps(merged, indent=2))  # last: its presence means complete
        (out / MERGING).unlink()
        return merged
    finally:
        lock.release()


def unfinished_merge(out: Path) -> bool:
    """`out` holds a merge's marker and only what a merge writes before its manifest (shards, the data report): a
    merge that failed or was killed, which the same command may start again. Anything else there is somebody's and
    stays (a dataset's own `data/*.parquet` was taken for a merge's and deleted)."""
    if (out / MANIFEST).exists() or not (out / MERGING).is_file():
        return False
    for entry in out.iterdir():
        if entry.name in (LOCK_FILE, MERGING, "data_report.md", "data_report.png"):
            continue
        if entry.name != SHARD_DIR or not entry.is_dir():
            return False
        if any(not is_shard_file(shard.name) for shard in entry.iterdir()):
            return False
    return True


def _place(source: Path, target: Path, sha256: str) -> None:
    """Link (or copy) a shard and check it against its part's checksum: a part damaged since it was written must
    not become a silently wrong merged corpus."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if not source.is_file():
        raise MergeError(f"{source} is listed in its part's {MANIFEST} but missing; preprocess that part again")
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
        with open(target, "rb") as handle:  # a copy's pages on storage before the manifest vouches for them
            fsync_if_supported(handle.fileno())
    if sha256_of(target) != sha256:
        target.unlink()
        raise MergeError(f"{source} does not match the sha256 in its part's {MANIFEST}: the file was damaged; "
                         "preprocess that part again")  # fmt: skip


def merged_manifest(manifests: list[dict], shards: list[dict], part_paths: list[str]) -> dict:
    first = manifests[0]
    stats, inputs_before = CorpusStats(), 0
    for manifest in manifests:
        stats = stats.merged(CorpusStats(**manifest["report"]["stats"]), inputs_before)
        inputs_before += len(manifest["settings"]["inputs"])
    skipped = {reason: sum(m["skipped"].get(reason, 0) for m in manifests) for reason in first["skipped"]}
    examples: dict[str, list] = {}
    for manifest in manifests:
        for reason, lines in manifest["skipped_examples"].items():
            examples.setdefault(reason, []).extend(lines)
    elapsed = [m["throughput"]["elapsed_s"] for m in manifests]
    counted = ("num_documents", "num_tokens", "num_document_tokens", "num_sequences", "dropped_tail_tokens")
    totals = {key: sum(m[key] for m in manifests) for key in counted}
    settings = {**first["settings"], "inputs": [i for m in manifests for i in m["settings"]["inputs"]], "part": None}
    if all("input_fingerprints" in m["settings"] for m in manifests):
        settings["input_fingerprints"] = [f for m in manifests for f in m["settings"]["input_fingerprints"]]
    return {
        **{key: first[key] for key in ("seq_len", "dtype", "tokenizer")},
        **(
            dict([SPECIAL_TOKENS_IN_TEXT])
            if all(m.get(SPECIAL_TOKENS_IN_TEXT[0]) == SPECIAL_TOKENS_IN_TEXT[1] for m in manifests)
            else {}
        ),  # fmt: skip
        **totals,
        "settings": settings,
        "skipped": skipped,
        "skipped_examples": {reason: lines[:EXAMPLES_PER_REASON] for reason, lines in examples.items()},
        "shards": shards,
        "report": {**summary({"skipped": skipped}, stats), "stats": stats.to_dict()},
        "throughput": {
            "document_tokens_per_s": totals["num_document_tokens"] / max(max(elapsed), 1e-9),
            "elapsed_s": max(elapsed),  # the parts run side by side
            "num_workers": sum(m["throughput"]["num_workers"] for m in manifests),
            "resumed": any(m["throughput"]["resumed"] for m in manifests),
            "peak_rss_mb_main": max(m["throughput"]["peak_rss_mb_main"] for m in manifests),
            "peak_rss_mb_worker": max(m["throughput"]["peak_rss_mb_worker"] for m in manifests),
        },
        "merged_from": [
            {
                "path": path,
                "num_documents": m["num_documents"],
                "num_tokens": m["num_tokens"],
                "dropped_tail_tokens": m["dropped_tail_tokens"],
            }
            for path, m in zip(part_paths, manifests, strict=True)
        ],  # fmt: skip
        "dedup_scope": "per part" if (first["settings"].get("filters") or {}).get("dedup") else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", help="the part directories (python -m data_prep.preprocess --part I)")
    parser.add_argument("--output", required=True, help="the merged directory (new or empty)")
    args = parser.parse_args(argv)
    try:
        manifest = merge(args.parts, args.output)
    except MergeError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    print(f"{manifest['num_documents']:,} documents, {manifest['num_tokens']:,} tokens in {len(manifest['shards'])} "
          f"shard(s) from {len(args.parts)} part(s) -> {args.output}")  # fmt: skip
    return DONE


if __name__ == "__main__":  # the same command by its module path
    sys.exit(main())
