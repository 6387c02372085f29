"""The package's shape: importing the PEFT method loads no application dependency, its namespace is the PEFT method,
and no module imports itself back through others."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import peft_smear


PACKAGE = Path(peft_smear.__file__).parent
APPLICATION_ONLY = ("datasets", "pyarrow", "matplotlib")


def imported_top_level_packages(code: str) -> set[str]:
    script = f"import sys, json\n{code}\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def test_importing_the_peft_method_loads_no_application_dependency():
    assert not imported_top_level_packages("import peft_smear") & set(APPLICATION_ONLY)


def test_the_command_line_loads_the_training_stack_only_to_train():
    loaded = imported_top_level_packages("from peft_smear.cli import build_parser; build_parser()")
    assert not loaded & set(APPLICATION_ONLY)
    assert "datasets" in imported_top_level_packages("import peft_smear.multitask.training")


def test_the_top_level_namespace_is_the_peft_method():
    assert "MultiTaskModel" not in peft_smear.__all__ and "RoutingReport" not in peft_smear.__all__
    for name in ("SmearConfig", "SmearModel", "get_routing_weights", "export_merged_adapter", "ROUTERS"):
        assert name in peft_smear.__all__ and hasattr(peft_smear, name)


def runtime_imports(path: Path) -> set[str]:
    """The package modules ``path`` imports when it runs: relative and absolute ``peft_smear`` imports, outside
    ``if TYPE_CHECKING:`` blocks (those never execute)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            target = ".".join(part for part in (base, node.module) if part)
            if target.startswith("peft_smear"):
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)  # `from . import submodule`
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("peft_smear"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
        for path in PACKAGE.rglob("*.py")
    }
    return {name: runtime_imports(path) & set(modules) - {name} for name, path in modules.items()}


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "peft_smear.config" in graph and graph["peft_smear.layer"], "the walk must see the package's imports"
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                raise AssertionError(f"import cycle: {' -> '.join([*path, module, target])}")
            if target not in state:
                visit(target, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_config_depends_only_on_the_registries_and_registration():
    """``config.py`` is a leaf of the PEFT method: it reads the routing methods' and expert kinds' traits from their
    tables, and nothing that runs a model (layer, tuner, routing context) is reachable from it."""
    graph, reachable, todo = import_graph(), set(), ["peft_smear.config"]
    while todo:
        for target in graph[todo.pop()] - reachable:
            reachable.add(target)
            todo.append(target)
    assert not reachable & {"peft_smear.layer", "peft_smear.model", "peft_smear.context", "peft_smear.export"}
    assert not any(name.startswith("peft_smear.multitask") for name in reachable)
