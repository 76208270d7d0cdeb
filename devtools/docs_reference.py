"""The manual's reference pages, generated from the code so that they cannot drift.

Each page under ``docs/reference/`` holds a marker line ``<!-- reference: NAME -->``
that the MkDocs hook (``devtools/mkdocs_hooks.py``) replaces with ``PAGES[NAME]()``
at build time:

* ``settings`` -- every field of the settings dataclasses, with its type, default,
  environment variable and meaning (the comment written beside the field);
* ``rest-api`` -- every operation of the REST API's OpenAPI schema;
* ``cli`` -- every ``gateway`` command's help, from its argparse parsers;
* ``metrics`` -- every Prometheus metric family the exporter serves.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import re
import textwrap
import typing
from typing import Any, Callable, Iterator

MARKER = re.compile(r"^<!-- reference: ([a-z-]+) -->$", re.M)


def render(markdown: str) -> str:
    """``markdown`` with every reference marker replaced by its generated page body."""
    return MARKER.sub(lambda m: PAGES[m.group(1)]().rstrip() + "\n", markdown)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


# -- settings -------------------------------------------------------------------------

def field_comments(cls: type) -> dict[str, str]:
    """The comment written beside each field of a dataclass: the ``#`` lines just above
    it, then the one at the end of its line."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    tree = ast.parse(source)
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        i = node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        line = lines[node.end_lineno - 1]
        trailing = line.split("  #", 1)[1].strip() if "  #" in line else ""
        out[node.target.id] = " ".join(part for part in (" ".join(above), trailing) if part)
    return out


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is not None:
        text = str(tp)
    else:
        text = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return re.sub(r"\b[\w.]+\.(\w+)", r"\1", str(text))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value) or (isinstance(value, tuple) and value
                                               and dataclasses.is_dataclass(value[0])):
            return "see below"
    else:
        return "required"
    if not f.repr:
        return '""' if value == "" else "(secret)"
    return f"`{json.dumps(value) if not isinstance(value, tuple) else json.dumps(list(value))}`"


def _settings_table(cls: type, env_names: dict[str, str]) -> str:
    comments = field_comments(cls)
    hints = typing.get_type_hints(cls)
    rows = ["| setting | type | default | environment | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if not f.init or f.name == "config_source":
            continue
        env = f"`{env_names[f.name]}`" if f.name in env_names else ""
        rows.append(f"| `{f.name}` | `{_type_name(hints.get(f.name, f.type))}` | {_cell(_default(f))} "
                    f"| {env} | {_cell(comments.get(f.name, ''))} |")
    return "\n".join(rows)


def settings_page() -> str:
    from gateway_tasks.core import settings as s

    env_names = {name: var for var, (name, _conv) in s.ENV_SETTINGS.items()}
    out = io.StringIO()
    out.write("Top-level settings (the TOML file's top level, `Settings`):\n\n")
    out.write(_settings_table(s.Settings, env_names) + "\n")
    nested = [(f, typing.get_type_hints(s.Settings)[f.name]) for f in dataclasses.fields(s.Settings)]
    seen: set[type] = {s.Settings}
    for f, tp in nested:
        inner = typing.get_args(tp)[0] if typing.get_args(tp) else tp
        if not (isinstance(inner, type) and dataclasses.is_dataclass(inner)) or inner in seen:
            continue
        seen.add(inner)
        table = f"[[{f.name}]]" if typing.get_origin(tp) is tuple else f"[{f.name}]"
        doc = inspect.getdoc(inner) or ""
        out.write(f"\n## `{table}` ({inner.__name__})\n\n{doc}\n\n{_settings_table(inner, {})}\n")
        for sub in dataclasses.fields(inner):
            sub_tp = typing.get_type_hints(inner).get(sub.name)
            sub_inner = typing.get_args(sub_tp)[0] if typing.get_args(sub_tp) else sub_tp
            if isinstance(sub_inner, type) and dataclasses.is_dataclass(sub_inner) and sub_inner not in seen:
                nested.append((sub, sub_tp))
    out.write("\n## Built-in tiers and pools\n\n")
    for tier in s.default_tiers():
        values = ", ".join(f"`{k}` = `{json.dumps(list(v) if isinstance(v, tuple) else v)}`"
                           for k, v in dataclasses.asdict(tier).items() if k != "name")
        out.write(f"* **{tier.name}**: {values}\n")
    for pool in s.default_pools():
        public = {k: v for k, v in dataclasses.asdict(pool).items() if k not in ("name", "api_key")}
        values = ", ".join(f"`{k}` = `{json.dumps(list(v) if isinstance(v, tuple) else v)}`"
                           for k, v in public.items())
        out.write(f"* pool **{pool.name}**: {values}\n")
    return out.getvalue()


# -- REST API ---------------------------------------------------------------------------

def openapi_schema() -> dict[str, Any]:
    from gateway_tasks.core.settings import load_settings
    from gateway_tasks.producer.gateway import Gateway
    from gateway_tasks.rest.app import create_app

    settings = load_settings(env={"REDIS_URL": "redis://127.0.0.1:1/0"})   # never connected to
    return create_app(Gateway(settings)).openapi()


def rest_api_page() -> str:
    schema = openapi_schema()
    out = io.StringIO()
    out.write(f"{schema['info'].get('title', '')} {schema['info'].get('version', '')}: "
              "every operation of the OpenAPI schema the API serves at `/openapi.json`.\n")
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if method not in ("get", "post", "put", "delete", "patch"):
                continue
            out.write(f"\n## `{method.upper()} {path}`\n\n")
            summary = op.get("summary") or ""
            description = op.get("description") or ""
            out.write(f"{summary}\n\n" if summary else "")
            out.write(f"{description.strip()}\n\n" if description else "")
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body:
                out.write(f"Request body: `{_schema_name(body)}`.\n\n")
            out.write("| status | meaning | body |\n|---|---|---|\n")
            for status, resp in op.get("responses", {}).items():
                content = resp.get("content", {})
                kind = next(iter(content.values()), {}).get("schema") if content else None
                out.write(f"| {status} | {_cell(resp.get('description', ''))} | "
                          f"{_cell('`' + _schema_name(kind) + '`') if kind else ''} |\n")
    components = schema.get("components", {}).get("schemas", {})
    if components:
        out.write("\n## Schemas\n")
        for name, comp in sorted(components.items()):
            out.write(f"\n### `{name}`\n\n")
            if comp.get("description"):
                out.write(f"{_cell(comp['description'])}\n\n")
            props = comp.get("properties", {})
            if props:
                required = set(comp.get("required", []))
                out.write("| field | type | required | meaning |\n|---|---|---|---|\n")
                for prop, spec in props.items():
                    out.write(f"| `{prop}` | {_cell(_schema_name(spec))} | {'yes' if prop in required else ''} "
                              f"| {_cell(spec.get('description', spec.get('title', '')))} |\n")
    return out.getvalue()


def _schema_name(spec: dict[str, Any] | None) -> str:
    if not spec:
        return ""
    if "$ref" in spec:
        return spec["$ref"].rsplit("/", 1)[-1]
    for key in ("anyOf", "oneOf"):
        if key in spec:
            return " or ".join(_schema_name(s) for s in spec[key])
    if spec.get("type") == "array":
        return f"array of {_schema_name(spec.get('items'))}"
    return str(spec.get("type", "object"))


# -- CLI -------------------------------------------------------------------------------

def _subcommands(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:   # argparse keeps its subparsers here and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, f"{path} {name}")


def cli_page() -> str:
    from gateway_tasks.cli.main import build_parser

    out = io.StringIO()
    for path, parser in _subcommands(build_parser(), "gateway"):
        parser.prog = path
        level = "##" if path.count(" ") <= 1 else "###"
        out.write(f"\n{level} `{path}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return out.getvalue()


# -- metrics ---------------------------------------------------------------------------

def metric_families() -> list[tuple[str, str, str, list[str]]]:
    """(name, type, help, labels) of every family the exporter serves."""
    from gateway_tasks.core.settings import load_settings
    from gateway_tasks.metrics import exporter

    settings = load_settings(env={})
    snap = exporter.Snapshot(now_ms=0)
    seen: dict[str, tuple[str, str, str, list[str]]] = {}
    for family in exporter.families(snap, settings):
        labels = sorted(set(getattr(family, "_labelnames", ()))   # prometheus_client keeps them here
                        | {label for sample in family.samples for label in sample.labels})
        name = family.name + ("_total" if family.type == "counter" else "")
        seen.setdefault(name, (name, family.type, family.documentation, labels))
    return sorted(seen.values())


def metrics_page() -> str:
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, help_text, labels in metric_families():
        rows.append(f"| `{name}` | {kind} | {', '.join(labels)} | {_cell(help_text)} |")
    return "\n".join(rows) + "\n"


PAGES: dict[str, Callable[[], str]] = {
    "settings": settings_page,
    "rest-api": rest_api_page,
    "cli": cli_page,
    "metrics": metrics_page,
}
