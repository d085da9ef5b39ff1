"""The import graph is the architecture (DESIGN, "Layers: what may import what"): this
test reads every module's imports with `ast`, without importing anything, and holds
them to five rules.

(a) The contract imports only the contract. The contract is what a plugin is written
    against and what crosses a process boundary: hookspecs, interfaces (with the
    capability Protocols), datatypes (requests as policies see them, scheduler output,
    runner output, logprobs), messages (the wire format), sampling_params,
    pooling_params and config.
    Besides each other, its modules may import the `plugserve` package itself (hookimpl)
    and plugserve.plugins, through which config checks the names stack.yaml selects;
    never the engine, the worker, the frontend or a plugin.
(b) A plugin imports plugserve's public surface only: `plugserve` (hookimpl), the
    contract, plugserve.ops (the compiled ops: headers, build helper, huge pages),
    plugserve.user_cache (where it keeps what it makes once per machine) and
    plugserve.logging_utils; an executor also the worker API it drives (the model
    runner, worker.parallel, worker.pipeline) and plugserve.device; a linear method or a model pass also
    the layers it runs or rewrites (plugserve.worker.layers: the plain method it may
    build on, the decoder layer, attention, the gated MLP, the norms). Never another
    plugin package (its own package's modules are fine), never engine or frontend
    internals.
(c) The API-server side never imports the model runner or model code
    (plugserve.worker.model_runner, plugserve.worker.models, plugserve.worker.layers).
    Followed transitively from every plugserve.frontend module through every plugserve
    import, at module level and in functions, and through the registry, which loads
    every bundled entry-point plugin in every process: of a plugin module, what runs
    when it is loaded counts (module level, and its hook functions, which the registry
    calls); its components' methods run only where they are built. Not followed: the
    engine-process entry point's import of engine_proc, which runs in the spawned child.
(d) No import cycles among modules, counting the imports that run when a module is
    first imported: at module level, not under `if TYPE_CHECKING:` (never run) nor in
    functions (run once every module is loaded).
(e) The core imports no plugin, and no model file (the core's models, or a model package
    such as the SmolLM3 example) imports the CPU kernels (plugserve_plugins.cpu_bf16);
    nor does the core hold or include their C++ (cpu_gemm*, cpu_decoder*): how a layer
    runs on a CPU is a plugin's, the linear method's or the model pass's.
(f) `ray` (the optional extra `plugserve[ray]`) is imported only inside functions of the
    Ray executor's modules, which run where that executor is built; loading every
    plugin, as each process does, imports no ray.

Everywhere else an import under `if TYPE_CHECKING:` counts like any other: a type
annotation is a dependency of the layer that writes it. A failure names the file, the
line and the rule.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
# Import name -> folder, as pyproject.toml's package-dir maps them.
PACKAGE_DIRS = {"plugserve": ROOT / "core", "plugserve_plugins": ROOT / "plugins"}
# Model packages written as a third party's (rule e): import name -> folder.
MODEL_PACKAGE_DIRS = {
    "plugserve_smollm3": ROOT / "tests" / "plugins" / "plugserve-smollm3" / "plugserve_smollm3"
}

CONTRACT = (
    "plugserve.hookspecs",
    "plugserve.interfaces",
    "plugserve.capabilities",
    "plugserve.datatypes",
    "plugserve.messages",
    "plugserve.sampling_params",
    "plugserve.pooling_params",
    "plugserve.config",
)
CONTRACT_ALSO_MAY_IMPORT = ("plugserve", "plugserve.plugins")
PLUGIN_PUBLIC_SURFACE = (
    *CONTRACT,
    "plugserve",
    "plugserve.ops",
    "plugserve.user_cache",
    "plugserve.logging_utils",
    "plugserve.process_exit",
)
EXECUTOR_ALSO_MAY_IMPORT = (
    "plugserve.worker.model_runner",
    "plugserve.worker.parallel",
    "plugserve.worker.pipeline",
    "plugserve.device",
    "plugserve.child_processes",
)
# Plugins that hold linear methods or model passes, and what they may import beyond the
# public surface.
LAYER_PLUGINS = ("plugserve_plugins.linear_methods", "plugserve_plugins.cpu_bf16")
LAYER_PLUGIN_ALSO_MAY_IMPORT = ("plugserve.worker.layers",)
# The CPU kernels (rule e): the bf16 CPU fast path's package and its C++ sources.
CPU_KERNELS = "plugserve_plugins.cpu_bf16"
CPU_KERNEL_SOURCES = re.compile(r"^(cpu_gemm|cpu_decoder|cpu_encoder)\w*\.(cpp|h)$")
MODEL_FILES = "plugserve.worker.models"
API_SERVER = "plugserve.frontend"
NEVER_IN_API_SERVER = (
    "plugserve.worker.model_runner",
    "plugserve.worker.models",
    "plugserve.worker.layers",
)
# Imports that run in a process spawned by name, not in the one that names it.
SPAWNED_BY_NAME = {("plugserve.engine.entrypoint", "plugserve.engine.engine_proc")}

MODULE_LEVEL = "at module level"
TYPE_ONLY = "under TYPE_CHECKING"
IN_FUNCTION = "in a function"
IN_HOOK = "in a hook function"
BY_REGISTRY = "entry point the registry loads"


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported: `from a import b` names a.b where that is a module
    file: Path
    line: int
    kind: str

    def where(self) -> str:
        return f"{_shown(self.file)}:{self.line}"


Graph = dict[str, list[Import]]


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def within(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


# --------------------------------------------------------------------------- reading


def module_files(package_dirs: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every .py file under the mapped folders."""
    files = {}
    for top, folder in package_dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join((top, *parts))] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_hookimpl(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id == "hookimpl")
        or (isinstance(d, ast.Attribute) and d.attr == "hookimpl")
        for d in (dec.func if isinstance(dec, ast.Call) else dec for dec in function.decorator_list)
    )


def _import_statements(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with where it runs; a nested one keeps its outermost kind."""
    stack: list[tuple[ast.AST, str]] = [(tree, MODULE_LEVEL)]
    while stack:
        node, kind = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = IN_HOOK if _is_hookimpl(child) else IN_FUNCTION
                stack.append((child, inner if kind in (MODULE_LEVEL, TYPE_ONLY) else kind))
            elif isinstance(child, ast.Lambda):
                stack.append((child, IN_FUNCTION if kind == MODULE_LEVEL else kind))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                body = ast.Module(body=child.body, type_ignores=[])
                stack.append((body, TYPE_ONLY if kind == MODULE_LEVEL else kind))
                stack.append((ast.Module(body=child.orelse, type_ignores=[]), kind))
            else:
                stack.append((child, kind))


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]
) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: from the importing module's package, up level - 1
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        yield submodule if submodule in known else base


def read_graph(package_dirs: dict[str, Path]) -> Graph:
    """Every module's imports of the mapped packages (others are not this test's)."""
    files = module_files(package_dirs)
    known = set(files)
    graph: Graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[module] = [
            Import(module, target, path, node.lineno, kind)
            for node, kind in _import_statements(tree)
            for target in _targets(node, module, path.name == "__init__.py", known)
            if within(target, *package_dirs)
        ]
    return graph


def registry_imports(pyproject: Path, graph: Graph) -> list[Import]:
    """plugserve.plugins loads every entry point of the `plugserve` group: one import
    from it to each bundled plugin module."""
    text = pyproject.read_text()
    entry_points = tomllib.loads(text)["project"]["entry-points"]["plugserve"]
    lines = text.splitlines()
    found = []
    for name, target in entry_points.items():
        module = target.split(":")[0]
        line = next(i for i, s in enumerate(lines, 1) if re.match(rf"{re.escape(name)}\s*=", s))
        if module in graph:
            found.append(Import("plugserve.plugins", module, pyproject, line, BY_REGISTRY))
    return found


# --------------------------------------------------------------------------- rules


def contract_violations(graph: Graph) -> list[str]:
    return [
        f"{imp.where()}: rule (a), the contract imports only the contract: {imp.source} "
        f"imports {imp.target} ({imp.kind})"
        for module, imports in graph.items()
        if within(module, *CONTRACT)
        for imp in imports
        if not (within(imp.target, *CONTRACT) or imp.target in CONTRACT_ALSO_MAY_IMPORT)
    ]


def _plugin_package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def plugin_violations(graph: Graph) -> list[str]:
    found = []
    for module, imports in graph.items():
        if not within(module, "plugserve_plugins") or module == "plugserve_plugins":
            continue
        own = _plugin_package(module)
        # `plugserve` itself, but not everything under it.
        public = [p for p in PLUGIN_PUBLIC_SURFACE if p != "plugserve"]
        if within(module, "plugserve_plugins.executors"):
            public += EXECUTOR_ALSO_MAY_IMPORT
        if within(module, *LAYER_PLUGINS):
            public += LAYER_PLUGIN_ALSO_MAY_IMPORT
        for imp in imports:
            if within(imp.target, "plugserve_plugins"):
                ok = within(imp.target, own)
                why = f"another plugin package, not {own}'s own"
            else:
                ok = imp.target == "plugserve" or within(imp.target, *public)
                why = "not plugserve's public surface"
            if not ok:
                found.append(
                    f"{imp.where()}: rule (b), a plugin imports only plugserve's public "
                    f"surface: {module} imports {imp.target} ({imp.kind}): {why}"
                )
    return found


def _followed(imp: Import) -> bool:
    """Whether an import runs in the process that imports `imp.source` (rule c)."""
    if (imp.source, imp.target) in SPAWNED_BY_NAME:
        return False
    if within(imp.source, "plugserve_plugins"):
        return imp.kind in (MODULE_LEVEL, IN_HOOK)
    return True


def api_server_violations(graph: Graph, extra: Iterable[Import] = ()) -> list[str]:
    """Breadth first from every frontend module; each import that first crosses into the
    forbidden modules is reported with the shortest chain that leads to it."""
    edges: Graph = {module: list(imports) for module, imports in graph.items()}
    for imp in extra:
        edges.setdefault(imp.source, []).append(imp)
    came_by: dict[str, Import | None] = {m: None for m in graph if within(m, API_SERVER)}
    queue = deque(came_by)
    found = []
    while queue:
        module = queue.popleft()
        for imp in edges.get(module, []):
            if imp.target in came_by or not _followed(imp):
                continue
            came_by[imp.target] = imp
            if within(imp.target, *NEVER_IN_API_SERVER):
                chain = _chain(came_by, imp)
                found.append(
                    f"{imp.where()}: rule (c), the API server never imports the model runner "
                    f"or model code: {imp.source} imports {imp.target} ({imp.kind}), reached "
                    f"by {chain}"
                )
            else:
                queue.append(imp.target)
    return found


def _chain(came_by: dict[str, Import | None], last: Import) -> str:
    hops = [last]
    while (previous := came_by[hops[-1].source]) is not None:
        hops.append(previous)
    return " -> ".join(
        [hops[-1].source, *(f"{h.target} ({h.where()}, {h.kind})" for h in reversed(hops))]
    )


def cycles(graph: Graph) -> list[list[Import]]:
    """One cycle per strongly connected group of modules (Tarjan), as its imports."""
    edges = {
        m: [i for i in imports if i.kind == MODULE_LEVEL and i.target in graph]
        for m, imports in graph.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        on_stack.append(module)
        for imp in edges[module]:
            if imp.target not in index:
                visit(imp.target)
                low[module] = min(low[module], low[imp.target])
            elif imp.target in on_stack:
                low[module] = min(low[module], index[imp.target])
        if low[module] == index[module]:
            group = set()
            while (member := on_stack.pop()) != module:
                group.add(member)
            groups.append(group | {module})

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return [_cycle_through(min(g), g, edges) for g in groups if len(g) > 1] + [
        [i] for m in edges for i in edges[m] if i.target == m
    ]


def _cycle_through(start: str, group: set[str], edges: Graph) -> list[Import]:
    """The shortest path from `start` back to itself inside its group."""
    came_by: dict[str, Import] = {}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for imp in edges[module]:
            if imp.target not in group or imp.target in came_by:
                continue
            came_by[imp.target] = imp
            if imp.target == start:
                path = [imp]
                while path[-1].source != start:
                    path.append(came_by[path[-1].source])
                return path[::-1]
            queue.append(imp.target)
    raise AssertionError(f"{start} is in a cycle group but no path returns to it")


def cycle_violations(graph: Graph) -> list[str]:
    return [
        f"{cycle[0].where()}: rule (d), no import cycles: "
        + " -> ".join([cycle[0].source, *(f"{i.target} ({i.where()})" for i in cycle)])
        for cycle in cycles(graph)
    ]


def cpu_kernel_violations(graph: Graph, model_packages: Iterable[str] = ()) -> list[str]:
    """Imports of a plugin by the core, and of the CPU kernels by a model file."""
    found = []
    for module, imports in graph.items():
        core = within(module, "plugserve")
        model_file = within(module, MODEL_FILES, *model_packages)
        for imp in imports:
            if core and within(imp.target, "plugserve_plugins"):
                what = "the core imports no plugin"
            elif model_file and within(imp.target, CPU_KERNELS):
                what = "a model file imports no CPU kernel"
            else:
                continue
            found.append(
                f"{imp.where()}: rule (e), {what}: {module} imports {imp.target} ({imp.kind})"
            )
    return found


def cpu_kernel_source_violations(core: Path) -> list[str]:
    """The CPU kernels' C++ held in the core, or included by its sources."""
    found = []
    for path in sorted(core.rglob("*")):
        if not path.is_file() or path.suffix not in (".cpp", ".h", ".py"):
            continue
        if CPU_KERNEL_SOURCES.match(path.name):
            found.append(f"{_shown(path)}: rule (e), the core holds no CPU kernel's C++")
            continue
        if path.suffix == ".py":
            continue
        for line_number, line in enumerate(path.read_text().splitlines(), 1):
            included = re.match(r'\s*#\s*include\s*"([^"]+)"', line)
            if included and CPU_KERNEL_SOURCES.match(included.group(1)):
                found.append(
                    f"{_shown(path)}:{line_number}: rule (e), the core includes no CPU "
                    f"kernel's header: {included.group(1)}"
                )
    return found


# --------------------------------------------------------------------------- the tree


@pytest.fixture(scope="module")
def graph() -> Graph:
    return read_graph(PACKAGE_DIRS)


def _report(violations: list[str]) -> str:
    return f"{len(violations)} forbidden import(s):\n" + "\n".join(violations)


def test_the_contract_imports_only_the_contract(graph: Graph) -> None:
    violations = contract_violations(graph)
    assert not violations, _report(violations)


def test_plugins_import_only_the_public_surface(graph: Graph) -> None:
    violations = plugin_violations(graph)
    assert not violations, _report(violations)


def test_the_api_server_never_imports_the_model_runner_or_model_code(graph: Graph) -> None:
    violations = api_server_violations(graph, registry_imports(ROOT / "pyproject.toml", graph))
    assert not violations, _report(violations)


def test_no_import_cycles(graph: Graph) -> None:
    violations = cycle_violations(graph)
    assert not violations, _report(violations)


def test_the_core_and_model_files_never_import_the_cpu_kernels(graph: Graph) -> None:
    models = read_graph({**PACKAGE_DIRS, **MODEL_PACKAGE_DIRS})
    violations = cpu_kernel_violations(models, MODEL_PACKAGE_DIRS)
    violations += cpu_kernel_source_violations(ROOT / "core")
    assert not violations, _report(violations)


def test_the_reader_finds_the_modules_the_rules_name(graph: Graph) -> None:
    # A renamed module must not turn a rule into one that checks nothing.
    named = [*CONTRACT, *PLUGIN_PUBLIC_SURFACE, *EXECUTOR_ALSO_MAY_IMPORT, *NEVER_IN_API_SERVER]
    named += [*LAYER_PLUGINS, *LAYER_PLUGIN_ALSO_MAY_IMPORT, CPU_KERNELS, MODEL_FILES]
    named += [module for pair in SPAWNED_BY_NAME for module in pair]
    assert [m for m in named if m not in graph] == []
    models = read_graph({**PACKAGE_DIRS, **MODEL_PACKAGE_DIRS})
    assert [m for m in MODEL_PACKAGE_DIRS if m not in models] == []
    assert any(within(m, API_SERVER) for m in graph)
    assert registry_imports(ROOT / "pyproject.toml", graph)


# --------------------------------------------------------------------------- the rules


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


FORBIDDEN = {
    "core/__init__.py": "",
    "core/interfaces.py": (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from plugserve.engine.core import Scheduler\n"
    ),
    "core/engine/__init__.py": "",
    "core/engine/core.py": "import plugserve.worker.model_runner\n",
    "core/engine/entrypoint.py": "def run():\n    from plugserve.engine import engine_proc\n",
    "core/engine/engine_proc.py": "from plugserve.worker.models import llama\n",
    "core/frontend/__init__.py": "",
    "core/frontend/app.py": (
        "from plugserve.engine import entrypoint\ndef handler():\n    from ..engine import core\n"
    ),
    "core/worker/__init__.py": "",
    "core/worker/model_runner.py": "from . import helper\n",
    "core/worker/helper.py": "from plugserve.worker import model_runner\n",
    "core/worker/models/__init__.py": "",
    "core/worker/models/llama.py": "",
    "core/worker/models/qwen.py": "from plugserve_plugins.cpu_bf16 import fused_layer\n",
    "core/ops/cpu_gemm.cpp": "",
    "core/ops/cpu_ops.cpp": '#include "cpu_ops.h"\n#include "cpu_decoder.h"\n',
    "plugins/cpu_bf16/__init__.py": "",
    "plugins/cpu_bf16/fused_layer.py": "",
    "models/acme/__init__.py": "from plugserve_plugins.cpu_bf16 import fused_layer\n",
    "plugins/__init__.py": "",
    "plugins/a/__init__.py": "",
    "plugins/a/x.py": "from plugserve_plugins.a import y\nfrom plugserve_plugins.b import y\n",
    "plugins/a/y.py": "from plugserve.engine.core import Scheduler\n",
    "plugins/b/__init__.py": "",
    "plugins/b/y.py": "from plugserve import hookimpl\nfrom plugserve.interfaces import Renderer\n",
}


def test_each_rule_names_the_file_and_line_of_a_forbidden_import(tmp_path: Path) -> None:
    _write(tmp_path, FORBIDDEN)
    roots = {"plugserve": tmp_path / "core", "plugserve_plugins": tmp_path / "plugins"}
    graph = read_graph(roots)

    (contract,) = contract_violations(graph)
    assert contract.startswith(f"{tmp_path}/core/interfaces.py:3: rule (a)")
    assert "imports plugserve.engine.core (under TYPE_CHECKING)" in contract

    plugin = plugin_violations(graph)
    assert [v.split(": rule")[0] for v in plugin] == [
        f"{tmp_path}/plugins/a/x.py:2",
        f"{tmp_path}/plugins/a/y.py:1",
    ]
    assert "another plugin package" in plugin[0] and "public surface" in plugin[1]

    # Through a function-level relative import; not through the spawned entry point.
    (server,) = api_server_violations(graph)
    assert server.startswith(f"{tmp_path}/core/engine/core.py:1: rule (c)")
    assert server.endswith(
        f"plugserve.frontend.app -> plugserve.engine.core ({tmp_path}/core/frontend/app.py:3, "
        f"in a function) -> plugserve.worker.model_runner ({tmp_path}/core/engine/core.py:1, "
        "at module level)"
    )

    with_models = read_graph({**roots, "acme": tmp_path / "models" / "acme"})
    core_import, model_import = cpu_kernel_violations(with_models, ["acme"])
    assert core_import.startswith(f"{tmp_path}/core/worker/models/qwen.py:1: rule (e)")
    assert "the core imports no plugin" in core_import
    assert model_import.startswith(f"{tmp_path}/models/acme/__init__.py:1: rule (e)")
    assert "a model file imports no CPU kernel" in model_import
    assert cpu_kernel_source_violations(tmp_path / "core") == [
        f"{tmp_path}/core/ops/cpu_gemm.cpp: rule (e), the core holds no CPU kernel's C++",
        f"{tmp_path}/core/ops/cpu_ops.cpp:2: rule (e), the core includes no CPU kernel's "
        "header: cpu_decoder.h",
    ]

    (cycle,) = cycle_violations(graph)
    assert cycle == (
        f"{tmp_path}/core/worker/helper.py:1: rule (d), no import cycles: "
        f"plugserve.worker.helper -> plugserve.worker.model_runner ({tmp_path}/core/worker/"
        f"helper.py:1) -> plugserve.worker.helper ({tmp_path}/core/worker/model_runner.py:1)"
    )


def test_type_checking_and_function_imports_do_not_make_cycles(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/a.py": "import plugserve.b\n",
            "core/b.py": (
                "import typing\n"
                "if typing.TYPE_CHECKING:\n"
                "    import plugserve.a\n"
                "def later():\n"
                "    import plugserve.a\n"
            ),
        },
    )
    assert cycle_violations(read_graph({"plugserve": tmp_path / "core"})) == []


RAY_MODULES = ("plugins/executors/ray_executor.py", "plugins/executors/ray_worker.py")


def _imports_ray(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "ray" for alias in node.names)
    return isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray"


def test_ray_is_imported_only_in_the_ray_executors_functions() -> None:
    violations = []
    for path in sorted([*(ROOT / "core").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        in_function = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for inner in ast.walk(node)
        }
        name = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if _imports_ray(node) and (name not in RAY_MODULES or id(node) not in in_function):
                violations.append(f"{name}:{node.lineno}: rule (f), imports ray")
    assert not violations, violations


def test_loading_every_plugin_imports_no_ray() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from plugserve.plugins import get_registry; r = get_registry(); "
        "[r.implementations(s) for s in ('executor', 'scheduler', 'transport')]; "
        "print('ray' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "False", result.stdout + result.stderr
