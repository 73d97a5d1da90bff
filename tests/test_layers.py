"""The package's layers: no module imports from a layer above its own, and no import circle.

Every import counts, those inside functions too (a circle of deferred imports is still a circle: each module of it
needs the others), except those under ``if TYPE_CHECKING``. ``docs/architecture.md`` ("Layers") explains the order.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hf_tpu"

# Bottom to top. A module belongs to the layer of the longest prefix naming it.
LAYERS = (
    ("hf_tpu._import_hooks",),
    ("hf_tpu.backend", "hf_tpu.kernels.pallas"),
    ("hf_tpu.distributed",),
    ("hf_tpu.compile",),
    ("hf_tpu.kernels", "hf_tpu.sharding", "hf_tpu.tp_plans", "hf_tpu.export"),
    ("hf_tpu.integrations",),
    ("hf_tpu.device_module", "hf_tpu.registration", "hf_tpu._autoload", "hf_tpu"),
    ("hf_tpu.cli",),
)


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - level + 1]
    return ".".join(base + ([name] if name else []))


def _imports(module: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The package's modules that ``module`` imports (``from package import submodule`` names the submodule)."""
    tree = ast.parse(path.read_text())
    type_checking = {id(node) for block in ast.walk(tree)
                     if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                     for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, path.name == "__init__.py", node.level, node.module)
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            name = node.args[0].value
            stripped = name.lstrip(".")
            level = len(name) - len(stripped)
            found.add(_absolute(module, path.name == "__init__.py", level, stripped or None) if level else name)
    return {name for name in found if name in modules and name != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def _layer(module: str) -> int:
    matches = [(len(prefix), index) for index, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)"
    return max(matches)[1]


def test_the_import_reader_sees_deferred_and_relative_imports():
    graph = _graph()
    assert "hf_tpu.backend.dispatch" in graph["hf_tpu.backend.op_table"]  # from .dispatch import ...
    assert "hf_tpu.backend.ops" in graph["hf_tpu.backend.op_table"]  # from . import ops
    assert "hf_tpu.backend.op_table" in graph["hf_tpu.backend.fallback"]  # inside a function
    assert "hf_tpu.kernels.jax_interop" in graph["hf_tpu.device_module"]  # importlib.import_module("..")
    assert "hf_tpu.backend.ops.linalg" in graph["hf_tpu.backend.ops.attention"]  # from .linalg import ...


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{module} (layer {_layer(module)}) imports {imported} (layer {_layer(imported)})"
              for module, imported_modules in sorted(_graph().items()) for imported in sorted(imported_modules)
              if _layer(imported) > _layer(module)]
    assert not upward, "\n".join(upward)


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules, in import order), None if there is none."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state:
                found = visit(imported)
                if found:
                    return found
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_the_circle_finder_finds_a_circle():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_circle():
    circle = _circle(_graph())
    assert circle is None, " -> ".join(circle)
