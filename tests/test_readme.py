"""The README's commands work as written, from a clean clone.

* the "Run it by hand" block runs verbatim in bash (only REDIS_URL is pointed at
  the test's Redis, and GATEWAY_KEY_PREFIX isolates its keys): simulator,
  worker, beat, REST API, a tenant, a chat completion through the queue, a cron;
* the "Using it" Python block runs against a real worker and the simulator;
* the "A real upstream" recipe, applied to a copy of gateway.example.toml as it says,
  runs a real worker and `gateway api` against the simulator requiring the key, the
  key given to the worker only;
* every `gateway ...` line parses with the CLI, every `make` target exists, every
  `celery -A` module has an app, and gateway.example.toml loads.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from gateway_tasks.cli.main import build_parser
from devtools.cli import build_parser as build_dev_parser
from gateway_tasks.core.settings import Settings, load_settings
from devtools import processes
from devtools.env_deployment import EnvDeployment
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import Gateway

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
# the README and the manual: every command either names must be real
MANUAL = "\n".join([README, *(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").rglob("*.md")))])
README_REDIS = "redis://127.0.0.1:6379/0"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def section_block(title: str, language: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    found = re.findall(rf"^```{language}\n(.*?)^```", README[start:end], flags=re.S | re.M)
    assert len(found) == 1, f"section {title!r} should hold one {language} block"
    return found[0]


def command_lines(text: str) -> list[str]:
    joined = text.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_every_gateway_make_and_celery_command_is_real():
    parser = build_parser()
    dev_parser = build_dev_parser()
    makefile = (ROOT / "Makefile").read_text()
    seen = {"gateway": 0, "make": 0, "celery": 0, "gateway-dev": 0}
    for block in re.findall(r"^```sh\n(.*?)^```", MANUAL, flags=re.S | re.M):
        for line in command_lines(block):
            for part in re.split(r"&&|\$\(|\|", line):
                argv = shlex.split(part.strip().rstrip("&").rstrip(")"))
                if not argv:
                    continue
                if argv[0] in ("gateway", "gateway-dev"):
                    (parser if argv[0] == "gateway" else dev_parser).parse_args(argv[1:])  # exits on a bad command
                    seen[argv[0]] += 1
                elif argv[0] == "make":
                    for target in argv[1:]:
                        assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), target
                    seen["make"] += 1
                elif argv[0] == "celery":
                    module = argv[argv.index("-A") + 1]
                    assert hasattr(__import__(module, fromlist=["app"]), "__getattr__"), module
                    seen["celery"] += 1
    # inline commands in the prose too (`gateway redis --port 6379 --dir .redis-data`,
    # `gateway cron add|list|delete|bench`): each names a real command path
    for span in re.findall(r"`(gateway [^`]+)`", MANUAL):
        head, _, alternatives = span.partition("|")
        argv = shlex.split(head)
        for alt in [argv[-1], *alternatives.split("|")] if alternatives else [None]:
            path = argv[1:] if alt is None else [*argv[1:-1], alt]
            with pytest.raises(SystemExit) as exit_:
                with contextlib.redirect_stdout(io.StringIO()):
                    parser.parse_args([*path, "--help"])
            assert exit_.value.code == 0, span
        seen["gateway"] += 1
    # the dev tools' commands in the prose (`gateway-dev bench-lifecycle`, `gateway-dev chaos ...`)
    for span in re.findall(r"`(gateway-dev [^`]+)`", MANUAL):
        dev_parser.parse_args(shlex.split(span)[1:])
        seen["gateway-dev"] += 1
    assert seen["gateway-dev"] >= 10, seen
    assert seen["gateway"] >= 12 and seen["make"] >= 3 and seen["celery"] >= 2, seen


def test_example_config_loads_and_matches_the_defaults():
    s = load_settings(env={"GATEWAY_CONFIG": str(ROOT / "gateway.example.toml")})
    assert s.tiers == Settings().tiers and s.pools[0].base_url == "http://127.0.0.1:8099/v1"
    assert "gateway.example.toml" in README


@pytest.mark.slow
def test_run_it_by_hand_block_runs_as_written(redis_url, r, key_prefix, tmp_path):
    for port in (8099, 8080):
        assert port_free(port), f"port {port} is taken: the README's walk-through needs it"
    script = section_block("Run it by hand", "sh")
    assert README_REDIS in script
    script = script.replace(README_REDIS, redis_url)
    env = dict(os.environ, GATEWAY_KEY_PREFIX=key_prefix, PATH=f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}")
    for var in ("GATEWAY_CONFIG", "GATEWAY_SETTINGS_JSON", "GATEWAY_POOLS_JSON", "VIRTUAL_ENV"):
        env.pop(var, None)
    proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-3000:]
    completion = next(json.loads(line) for line in out.splitlines() if '"chat.completion"' in line)
    assert completion["object"] == "chat.completion" and completion["choices"][0]["message"]["content"]
    assert "registered acme:digest cron '0 * * * *' tier vip" in out
    assert re.search(r"^acme\s+digest\s+0 \* \* \* \*\s+vip\s+0\s", out, flags=re.M), out[-2000:]


@pytest.mark.slow
def test_using_it_python_block_runs_against_a_worker(settings, r, tmp_path):
    code = section_block("Using it", "python")
    with SimulatorThread(SimConfig(base_latency_ms=1)) as sim:
        pools = [{"name": "default", "base_url": sim.base_url, "api_key": "sk-test", "tpm": 600_000,
                  "rpm": 6_000, "models": ["gpt-4o-mini", "gpt-4o"]}]
        env = dict(os.environ, REDIS_URL=settings.redis_url, GATEWAY_KEY_PREFIX=settings.key_prefix,
                   GATEWAY_POOLS_JSON=json.dumps(pools))
        env.pop("GATEWAY_CONFIG", None)
        env.pop("GATEWAY_SETTINGS_JSON", None)
        s = load_settings(env=env)
        worker = processes.worker(s, concurrency=2, log_path=str(tmp_path / "w.log")).start()
        try:
            processes.wait_for_workers(Gateway(s, client=r).app, 1)
            check = code + "\nassert res['response']['object'] == 'chat.completion'\nprint('OK', res['tier'])\n"
            done = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=120)
        finally:
            worker.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("OK vip")


def bullet(title: str) -> str:
    """A bullet of the README's lists, ``* **<title>.** ...``, up to the next one."""
    start = README.index(f"* **{title}.**")
    return README[start:README.index("\n* **", start + 1)]


def indented_block(text: str, language: str) -> str:
    found = re.findall(rf"^  ```{language}\n(.*?)^  ```", text, flags=re.S | re.M)
    assert len(found) == 1, f"expected one {language} block in {text[:60]!r}"
    return textwrap.dedent(found[0])


def edited_pools(toml_text: str, lines: str) -> str:
    """The README's edit of the copy: in its [[pools]] table (the file's last table),
    each line replaces the line of the same key, and api_key_env the api_key line."""
    head, marker, pools = toml_text.rpartition("[[pools]]\n")
    assert marker and not re.search(r"^\[", pools, flags=re.M), "[[pools]] should be the last table"
    for line in lines.strip().splitlines():
        key = line.split("=", 1)[0].strip()
        target = "api_key" if key == "api_key_env" else key
        pools, n = re.subn(rf"^{target} = .*$", lambda _: line, pools, count=1, flags=re.M)
        assert n == 1, f"the example's [[pools]] table has no line for {target}"
    return head + marker + pools


@pytest.mark.slow
def test_real_upstream_recipe_runs_as_written(redis_url, r, key_prefix, tmp_path):
    text = bullet("A real upstream")
    edit, shell = indented_block(text, "toml"), indented_block(text, "sh")
    example = (ROOT / "gateway.example.toml").read_text()
    for line in edit.strip().splitlines():            # the example's own comment says the same
        assert f"#   {line.split('#')[0].strip()}\n" in example, line
    key = f"sk-readme-{uuid.uuid4().hex}"
    with SimulatorThread(SimConfig(base_latency_ms=1, api_key=key)) as sim:
        shutil.copy(ROOT / "gateway.example.toml", tmp_path)
        exported = re.findall(r"^export (\w+)=", shell, flags=re.M)
        script = shell.replace("=sk-...", f"={key}") + "".join(f'\necho "{v}=${v}"' for v in exported)
        run = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=30)
        assert run.returncode == 0, run.stderr
        values = dict(line.split("=", 1) for line in run.stdout.splitlines() if "=" in line)
        config = tmp_path / values.pop("GATEWAY_CONFIG")
        config.write_text(edited_pools(config.read_text(), edit.replace("https://api.openai.com/v1", sim.base_url)))
        pool = load_settings(env={"GATEWAY_CONFIG": str(config)}).pools[0]
        assert pool.api_key == "" and values == {pool.api_key_env: key}   # the key: in the environment only
        # the README quotes the error of a worker without it
        assert f"error: {pool.key_problem('this worker')}" in " ".join(text.replace("`", "").split())
        env = {"GATEWAY_CONFIG": str(config), "REDIS_URL": redis_url, "GATEWAY_KEY_PREFIX": key_prefix}
        with EnvDeployment(env, tmp_path, worker_env=values) as deployment:
            deployment.start()
            reply = deployment.chat(deployment.add_tenant("acme", "vip"), "Say hello")
            logs = deployment.logs()
        stats = sim.stats()
    assert reply.status_code == 200 and reply.json()["object"] == "chat.completion", reply.text
    assert stats["requests_ok"] >= 1 and stats["requests_unauthorized"] == 0, stats
    assert f"worker configuration: GATEWAY_CONFIG={config}; pool default {sim.base_url} (key present)" in logs["worker"]
    assert not [name for name, log in logs.items() if key in log]
