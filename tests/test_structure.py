"""The shape of the codebase, pinned: layers import one way (packages, and the roles inside `recipes` and
`data_prep`), no module imports itself back through others (TYPE_CHECKING, function-level and relative imports
included), the entry point is imported by nothing, and no function or module outside the tests grows past what a
reader takes in at once."""

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
# Inside `data_prep`, by role: reading files, loading tokenizers and the benchmarks' local copies at the bottom; quality
# (filters, decontamination, dedup, cleaning) and packing (rows, the stream, the preprocessed format and its reader) on
# them; preprocessing on all of those; parts and mixtures (merge, weighted blends) on top. The commands' modules at
# the top of data_prep/ (`python -m data_prep.preprocess`, ...) only import their role's main.
DATA_PREP_LAYERS = {
    "data_prep.reading": {"data_prep.reading"},
    "data_prep.benchmark_files": {"data_prep.benchmark_files"},
    "data_prep.tokenizer": {"data_prep.reading", "data_prep.tokenizer"},
    "data_prep.quality": {"data_prep.reading", "data_prep.benchmark_files", "data_prep.quality"},
    "data_prep.packing": {"data_prep.reading", "data_prep.tokenizer", "data_prep.packing"},
    "data_prep.preprocessing": {"data_prep.reading", "data_prep.tokenizer", "data_prep.benchmark_files",
                                "data_prep.quality", "data_prep.packing", "data_prep.preprocessing"},
    "data_prep.parts": {"data_prep.packing", "data_prep.preprocessing", "data_prep.parts"},
}  # fmt: skip
DATA_PREP_COMMANDS = {"preprocess": "preprocessing.cli", "clean": "quality.cleaning.cli", "merge": "parts.merge",
                      "train_tokenizer": "tokenizer.training", "demo_corpus": "reading.demo_corpus"}  # fmt: skip
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 450


def sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def imported_from(node: ast.ImportFrom, path: Path) -> str:
    """The absolute module of `from <module> import ...`, a relative one resolved as Python does: level 1 is the
    package of the file's directory (the module's package; for an __init__.py, the package itself), level 2 the one
    above, ... One that climbs past the top-level package (an ImportError when it runs) resolves from the repository
    root, so `from ...recipes import x` in data_prep/a/b.py still reads as importing recipes."""
    if not node.level:
        return node.module or ""
    package = path.relative_to(REPO).parent.parts
    base = package[: max(len(package) - (node.level - 1), 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def project_imports(path: Path, source: str | None = None) -> set[str]:
    """Every project module or name `path` imports anywhere (`source`: its text, when not the file's own)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = imported_from(node, path)  # "" for `from .. import x` at the top: x is a top-level name
            names.add(module)
            names.update(".".join(filter(None, (module, alias.name))) for alias in node.names)
    return {name for name in names if name.split(".")[0] in PACKAGES}


def test_relative_imports_count_as_the_modules_they_name():
    """Negative control: relative imports, function-level ones included, used to be skipped, so a telemetry module
    importing the trainer or the packed rows' reader importing preprocessing passed every layer check."""
    trackers = REPO / "recipes/telemetry/trackers.py"
    later = trackers.read_text() + "\n\ndef later():\n    from ..training import trainer\n    from . import metrics\n"
    assert {"recipes.training.trainer", "recipes.telemetry.metrics"} <= project_imports(trackers, later)
    package = REPO / "data_prep/packing/__init__.py"  # level 1 of an __init__.py is its own package
    assert project_imports(package, "from .rows import pack\nfrom ..preprocessing import pipeline\n") == {
        "data_prep.packing.rows", "data_prep.packing.rows.pack", "data_prep.preprocessing",
        "data_prep.preprocessing.pipeline"}  # fmt: skip
    reader = REPO / "data_prep/packing/packed_dataset.py"  # past the top-level package: read from the root
    assert project_imports(reader, "from ...recipes.training import trainer\nfrom ... import eval\n") == {
        "recipes.training", "recipes.training.trainer", "eval"}  # fmt: skip


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


def test_the_training_dataset_does_not_import_preprocessing():
    assert not any(name.startswith("data_prep.preprocess") for name in
                   project_imports(REPO / "data_prep/packing/packed_dataset.py"))  # fmt: skip


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


def wrong_role_imports(graph: dict[str, set[str]], role: str, layers: dict[str, set[str]]) -> list[str]:
    package = role.split(".")[0] + "."
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module == role or module.startswith(role + ".")
        for target in targets
        if target.startswith(package)
        and not any(target == allowed or target.startswith(allowed + ".") for allowed in layers[role])
    )


@pytest.mark.parametrize("role", sorted(RECIPE_LAYERS))
def test_the_roles_inside_recipes_import_one_way(role):
    assert not (wrong := wrong_role_imports(import_graph(), role, RECIPE_LAYERS)), wrong


@pytest.mark.parametrize("role", sorted(DATA_PREP_LAYERS))
def test_the_roles_inside_data_prep_import_one_way(role):
    assert not (wrong := wrong_role_imports(import_graph(), role, DATA_PREP_LAYERS)), wrong


def test_the_data_prep_role_check_would_see_packing_import_preprocessing():
    """Negative control: the packed rows' reader importing preprocessing (training would pull in the writer)."""
    graph = import_graph()
    graph["data_prep.packing.packed_dataset"].add("data_prep.preprocessing.pipeline")
    assert wrong_role_imports(graph, "data_prep.packing", DATA_PREP_LAYERS)


def test_data_prep_holds_roles_and_the_commands_only():
    """Every module of data_prep/ is in a role's package, except the commands' own (which only import their main)."""
    top = {path.stem for path in (REPO / "data_prep").glob("*.py")} - {"__init__"}
    assert top == set(DATA_PREP_COMMANDS)
    packages = {path.name for path in (REPO / "data_prep").iterdir() if (path / "__init__.py").exists()}
    assert packages == {role.split(".")[1] for role in DATA_PREP_LAYERS}
    for command, module in DATA_PREP_COMMANDS.items():
        assert project_imports(REPO / "data_prep" / f"{command}.py") == {f"data_prep.{module}",
                                                                         f"data_prep.{module}.main"}  # fmt: skip


def test_no_module_is_longer_than_a_sitting():
    long = [
        f"{path.relative_to(REPO)} ({lines} lines)"
        for package in PACKAGES
        for path in sources(package)
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, long


def test_the_entry_point_stays_short():
    """docs/training.md: recipes/pretrain.py, under 100 lines, only wires the run together."""
    assert len((REPO / "recipes/pretrain.py").read_text().splitlines()) < 100
