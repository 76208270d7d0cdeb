"""The manual builds, the front door stays short, and nothing carries history.

* `make docs`'s build (MkDocs, strict: a broken link, anchor or missing page fails) runs
  from the checkout, with the reference pages generated from the code;
* every setting has a meaning in the generated settings reference (the comment written
  beside its field), and every metric the exporter serves has its help text;
* README.md stays the front door (at most 250 lines), and its walk-through is the
  manual's, word for word;
* no line of README.md, docs/ (but benchmarks.md's one line above each table) or the
  code's comments carries a date, a commit hash, an issue number or a word about
  sessions, machines of the moment or people: how a figure moved belongs in commit
  messages and CHANGELOG.md.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from devtools import docs_reference

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# a calendar date (not an ISO timestamp used as data), a commit hash in prose, an issue
# number, a tag of the change that wrote the line, and the words of a dated note
HISTORY = re.compile(
    r"\b20\d\d-[01]\d-[0-3]\d\b(?!T)"
    r"|\b(?:issue|issues) #?\d+"
    r"|\[lifecycle\]"
    r"|\b(?:this|a fresh|another) session\b|\bsession's\b"
    r"|\bthis machine\b|\bon the machine\b|\bmachine of the moment\b"
    r"|\b(?:earlier|previous) runs?\b"
    r"|\bengineers?\b",
    re.I)
COMMIT = re.compile(r"(?<![\w/.#-])[0-9a-f]{7,12}(?![\w-])")
COMMENT = {".py": re.compile(r"#(.*)$|\"\"\"|'''"), ".lua": re.compile(r"--(.*)$")}
CODE_DIRS = ("gateway_tasks", "workers", "beat", "lua", "devtools", "deploy", "tests")


def test_the_manual_builds_strictly(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    settings = (tmp_path / "site" / "reference" / "settings" / "index.html").read_text()
    assert "max_json_depth" in settings and "queue_ttl_s" in settings
    assert "gateway_backlog_tokens" in (tmp_path / "site" / "reference" / "metrics" / "index.html").read_text()
    assert "/v1/chat/completions" in (tmp_path / "site" / "reference" / "rest-api" / "index.html").read_text()
    assert "gateway tenant add" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()


def _dataclasses_of_settings() -> list[type]:
    from gateway_tasks.core import settings as s

    found, todo = [], [s.Settings]
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.append(cls)
        for tp in typing.get_type_hints(cls).values():
            for inner in (tp, *typing.get_args(tp)):
                if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                    todo.append(inner)
    return found


@pytest.mark.parametrize("cls", _dataclasses_of_settings(), ids=lambda c: c.__name__)
def test_every_setting_has_a_meaning(cls):
    comments = docs_reference.field_comments(cls)
    missing = [f.name for f in dataclasses.fields(cls)
               if f.init and f.name not in ("config_source", "name") and not comments.get(f.name)]
    assert not missing, f"{cls.__name__}: write what these mean, as a comment beside the field: {missing}"


def test_every_metric_has_help():
    families = docs_reference.metric_families()
    assert len(families) > 30
    assert not [name for name, _kind, help_text, _labels in families if not help_text.strip()]


def test_readme_is_the_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    walk = re.compile(r"^```sh\n(make install && source .*?)^```", re.S | re.M)
    assert walk.findall(text) == walk.findall((DOCS / "getting-started.md").read_text()), \
        "README's walk-through and docs/getting-started.md's should be the same block"
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link


def _doc_lines() -> list[tuple[str, int, str]]:
    out = []
    for path in [README, *sorted(DOCS.rglob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines, 1):
            # benchmarks.md: the one line above each table says what ran it and where
            if path.name == "benchmarks.md" and line.startswith("*`") and line.rstrip().endswith(("*", ".*")):
                continue
            if path.name == "benchmarks.md" and i < len(lines) and line.startswith("*`"):
                continue
            out.append((str(path.relative_to(ROOT)), i, line))
    return out


def test_readme_and_manual_carry_no_history():
    found = [f"{p}:{i}: {line.strip()[:120]}" for p, i, line in _doc_lines()
             if HISTORY.search(line) or COMMIT.search(line)]
    assert not found, "\n".join(found)


def _comments(path: Path) -> typing.Iterator[tuple[int, str]]:
    suffix = path.suffix
    in_doc = False
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if suffix == ".lua":
            m = COMMENT[".lua"].search(line)
            if m:
                yield i, m.group(1)
            continue
        quotes = line.count('"""') + line.count("'''")
        if in_doc or quotes:
            yield i, line
            if quotes % 2:
                in_doc = not in_doc
            continue
        if "#" in line:
            yield i, line[line.index("#"):]
        elif suffix in (".yaml", ".yml", ".toml"):
            continue


def test_code_comments_carry_no_history():
    found = []
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in (".py", ".lua", ".yaml", ".yml", ".toml") or ".venv" in path.parts:
                continue
            for i, text in _comments(path):
                if HISTORY.search(text):
                    found.append(f"{path.relative_to(ROOT)}:{i}: {text.strip()[:120]}")
    assert not found, "\n".join(found)


def _spread(median, low=None, high=None, runs=3):
    return {"median": median, "min": low if low is not None else median,
            "max": high if high is not None else median, "runs": runs}


def test_bench_docs_rewrites_the_router_table_from_the_bench_json():
    from devtools.bench.docs_tables import rewrite, router_table

    result = {"config": {"runs": 3, "redis": "7.2.4"}, "spread": {
        "policies": {"wfq": {
            "share_pct": {"vip": _spread(70.1, 69.9, 70.3), "normal": _spread(19.9), "batch": _spread(10.0)},
            "vip_p99_wait_ms": _spread(5, 4, 9), "tpm_utilisation_pct": _spread(99.5, 98.0, 100.0),
            "requests_429": _spread(0), "rate_429_pct": _spread(0), "round_trips_per_msg": _spread(1.9)}},
        "plain_celery": {"overhead_x": _spread(0.6, 0.5, 0.7),
                         "tasks_per_s": {"plain": _spread(700), "gateway": _spread(1300)}}}}
    table = router_table(result, "a test machine")
    assert "3 runs, a test machine, Redis 7.2.4" in table
    assert "70.1 (69.9–70.3) : 19.9 (19.9–19.9) : 10.0 (10.0–10.0)" in table
    assert "| VIP p99 queue wait under the batch flood | 5 (4–9) ms | < 50 ms |" in table
    page = (DOCS / "benchmarks.md").read_text()
    new = rewrite(page, "router", table)
    assert table in new and "a test machine" not in page
    before, after = page.split("<!-- bench:router -->")[0], page.split("<!-- /bench:router -->")[1]
    assert new.startswith(before) and new.endswith(after)          # the prose around it untouched
    with pytest.raises(ValueError):
        rewrite(page, "no-such-table", table)
