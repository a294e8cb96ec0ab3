"""The README is the front door and docs/ the house: every relative link in them leads to a file of the repository
(and to a heading of it when it names one), none leaves the repository, and the README stays short."""

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"(?m)^#+ (.+)$", page.read_text())
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def broken_links(page: Path) -> list[str]:
    broken = []
    for match in LINK.finditer(page.read_text()):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if REPO.resolve() not in resolved.parents and resolved != REPO.resolve():
            broken.append(f"{target}: leaves the repository")
        elif not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_heading_of_the_repository(page):
    assert not broken_links(page)


def test_the_link_check_catches_a_broken_link_an_escape_and_a_missing_heading(tmp_path, monkeypatch):
    page = REPO / "docs" / "_link_check_probe.md"
    page.write_text("[a](nowhere.md) [b](../../outside.md) [c](training.md#no-such-heading) [d](training.md)\\n")
    try:
        assert [problem.split(":")[1].strip() for problem in broken_links(page)] == [
            "no such file", "leaves the repository", "no heading #no-such-heading in training.md"]  # fmt: skip
    finally:
        page.unlink()


def test_the_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "make demo" in readme and "make test" in readme
    linked = {Path(m.group(1)).name for m in re.finditer(r"\]\(docs/([^)#]+)", readme)}
    assert linked == {p.name for p in (REPO / "docs").glob("*.md")}, "every docs page is reachable from the README"


def test_the_table_of_exit_codes_is_the_code_and_each_row_names_a_test_that_asserts_it():
    """docs/run-safety.md's table, recipes/pretrain.py's docstring and the exceptions it maps agree, and each code's
    named test exists and checks that code (rank exit codes as torchrun reports them; 0 as the launch's)."""
    import ast

    table = (REPO / "docs" / "run-safety.md").read_text()
    rows = re.findall(r"^\| (\d) \| ([^|]+) \| `(tests/[\w/.]+)::(\w+)` \|$", table, flags=re.M)
    assert [int(code) for code, *_ in rows] == [0, 1, 2, 3, 4, 5]
    pretrain = (REPO / "recipes" / "pretrain.py").read_text()
    documented = re.search(r"Exit codes: (.+?)\.\n", pretrain, flags=re.S).group(1)
    assert [int(code) for code in re.findall(r"(\d) [a-z]", documented)] == [0, 1, 2, 3, 4, 5]
    from recipes.config import ConfigError
    from recipes.training.checkpointing import CheckpointSaveError
    from recipes.training.exit_codes import CODES
    from recipes.training.run_state import TrainingFault
    from recipes.training.train_data import DataStallError

    mapped = {ConfigError: 2, TrainingFault: 3, CheckpointSaveError: 4, DataStallError: 5}
    assert mapped == CODES, "the exceptions' codes in recipes/training/exit_codes.py changed: update the table"
    for code, _, path, name in rows:
        tree = ast.parse((REPO / path).read_text())
        functions = {node.name: ast.get_source_segment((REPO / path).read_text(), node) for node in tree.body
                     if isinstance(node, ast.FunctionDef)}  # fmt: skip
        assert name in functions, f"{path}::{name} is named in the table but does not exist"
        checks = f"returncode == {code}" if code == "0" else f"exitcode\\s*:\\s*{code}\\b"
        assert checks in functions[name], f"{path}::{name} does not check exit code {code}"
