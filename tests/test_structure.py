"""The shape of the codebase, pinned: layers import one way, the entry point is imported by nothing, and no
function outside the tests grows past what a reader takes in at once."""

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("common", "data_prep", "eval", "recipes", "benchmarks")
# what each layer may import from the project: data and eval never import the trainer
ALLOWED = {
    "common": set(),
    "data_prep": {"common", "data_prep"},
    "eval": {"common", "data_prep", "eval"},
    "recipes": {"common", "data_prep", "eval", "recipes"},
    "benchmarks": {"common", "data_prep", "eval", "recipes", "benchmarks"},
}
MAX_FUNCTION_LINES = 60


def sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def project_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] in PACKAGES}


@pytest.mark.parametrize("package", PACKAGES)
def test_layers_import_one_way(package):
    wrong = {
        f"{path.relative_to(REPO)} imports {name}"
        for path in sources(package)
        for name in project_imports(path)
        if name.split(".")[0] not in ALLOWED[package] | {""}
    }
    assert not wrong, sorted(wrong)


def test_nothing_imports_the_entry_point():
    importers = [
        str(path.relative_to(REPO))
        for package in (*PACKAGES, "tests")
        for path in (sources(package) if package != "tests" else sorted((REPO / "tests").rglob("*.py")))
        if "recipes.pretrain" in project_imports(path)
        or "recipes.pretrain" in path.read_text().replace(" ", "")
        and path.name != "test_structure.py"
    ]
    assert not importers


def test_the_training_dataset_does_not_import_the_preprocessing_cli():
    assert "data_prep.preprocess" not in project_imports(REPO / "data_prep/packed_dataset.py")


def test_no_function_is_longer_than_a_screen():
    long = []
    for package in PACKAGES:
        for path in sources(package):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
