"""The shape of the codebase, pinned: layers import one way (packages, and the roles inside `recipes`), no module
imports itself back through others (TYPE_CHECKING and function-level imports included), the entry point is imported
by nothing, and no function or module outside the tests grows past what a reader takes in at once."""

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
# Inside `recipes`, by role: the typed config and the model's arithmetic at the bottom, the planner and the run's
# telemetry on them (telemetry on the config only), the training loop on those, and the commands (pretrain, plan,
# export, ...) on top.
RECIPE_LAYERS = {
    "recipes.config": {"recipes.config"},
    "recipes.architecture": set(),
    "recipes.telemetry": {"recipes.config", "recipes.telemetry"},
    "recipes.planning": {"recipes.config", "recipes.architecture", "recipes.planning"},
    "recipes.training": {"recipes.config", "recipes.architecture", "recipes.planning", "recipes.telemetry",
                         "recipes.training"},
}  # fmt: skip
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 450


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


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every project module and the project modules it imports anywhere: at the top, under TYPE_CHECKING or inside a
    function. `from package import name` counts as importing the submodule when `name` is one."""
    modules = {module_name(path): path for package in PACKAGES for path in sources(package)}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in project_imports(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path for every set of modules that import each other round (depth-first from each module)."""
    cycles: list[list[str]] = []

    def reaches(start: str, goal: str, seen: set[str]) -> list[str] | None:
        for nxt in sorted(graph[start]):
            if nxt == goal:
                return [start, goal]
            if nxt not in seen:
                seen.add(nxt)
                path = reaches(nxt, goal, seen)
                if path:
                    return [start, *path]
        return None

    for module in sorted(graph):
        cycle = reaches(module, module, set())
        if cycle and not any(set(cycle) == set(known) for known in cycles):
            cycles.append(cycle)
    return cycles


def test_no_module_imports_itself_back():
    assert not find_cycles(import_graph()), [" -> ".join(cycle) for cycle in find_cycles(import_graph())]


def test_the_cycle_check_would_see_the_callbacks_import_the_trainer_again():
    """Negative control: the cycle the callbacks' old type-hint import made (trainer -> callbacks -> trainer)."""
    graph = import_graph()
    assert "recipes.training.callbacks" in graph["recipes.training.trainer"]
    graph["recipes.training.callbacks"].add("recipes.training.trainer")
    assert any({"recipes.training.callbacks", "recipes.training.trainer"} <= set(c) for c in find_cycles(graph))


@pytest.mark.parametrize("role", sorted(RECIPE_LAYERS))
def test_the_roles_inside_recipes_import_one_way(role):
    graph = import_graph()
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module == role or module.startswith(role + ".")
        for target in targets
        if target.startswith("recipes.")
        and not any(target == allowed or target.startswith(allowed + ".") for allowed in RECIPE_LAYERS[role])
    )
    assert not wrong, wrong


def test_no_module_is_longer_than_a_sitting():
    long = [
        f"{path.relative_to(REPO)} ({lines} lines)"
        for package in PACKAGES
        for path in sources(package)
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, long
