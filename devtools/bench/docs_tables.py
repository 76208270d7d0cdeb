"""`gateway-dev bench-docs`: docs/benchmarks.md's tables written from the benches' JSON.

A table the benches write sits between two marker lines in docs/benchmarks.md,
``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; ``rewrite`` replaces what is
between them (the one line saying what ran it and where, then the table) and leaves
the prose around it alone.  ``make bench-docs`` runs the router bench three times
with ``--json`` and rewrites its table:

    gateway-dev bench --runs 3 --policies wfq --json > .bench/router.json
    gateway-dev bench-docs --router .bench/router.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
from pathlib import Path
from typing import Any

from devtools.bench.spread_report import spread_text

DOCS = Path(__file__).resolve().parent.parent.parent / "docs" / "benchmarks.md"


def machine() -> str:
    """What the bench ran on, as the table's heading line says it."""
    return f"{os.cpu_count()} cores, {platform.system()} {platform.machine()}, Python {platform.python_version()}"


def router_table(result: dict[str, Any], where: str) -> str:
    """The router bench's headline table from ``gateway-dev bench --runs N --json``."""
    runs = result["config"]["runs"]
    wfq = result["spread"]["policies"]["wfq"]
    plain = result["spread"].get("plain_celery")
    shares = wfq["share_pct"]
    rows = [
        f"*`gateway-dev bench --runs {runs} --policies wfq` (`make bench-docs`), {runs} runs, "
        f"{where}, Redis {result['config']['redis']}.*",
        "",
        "| measure | median (min–max) | target |",
        "|---|---|---|",
        f"| token shares {' : '.join(shares)}, all backlogged | "
        + " : ".join(spread_text(s, 1) for s in shares.values()) + " | ±3 points of 70:20:10 |",
        f"| VIP p99 queue wait under the batch flood | {spread_text(wfq['vip_p99_wait_ms'], 0, 'never')} ms | < 50 ms |",
        f"| upstream TPM used, all backlogged | {spread_text(wfq['tpm_utilisation_pct'], 1)} % | ≥ 95 % |",
        f"| upstream 429s | {spread_text(wfq['requests_429'])} ({spread_text(wfq['rate_429_pct'], 3)} %) | ≤ 0.1 % |",
        f"| dispatch round trips per message, bucket-bound | {spread_text(wfq['round_trips_per_msg'], 2, 'unbounded')} | |",
    ]
    if plain:
        rows += [
            f"| gateway time / plain Celery time, no-op task | {spread_text(plain['overhead_x'], 2, 'unbounded')}× | ≤ 1.3× |",
            f"| no-op tasks/s, plain Celery vs gateway | {spread_text(plain['tasks_per_s']['plain'])} vs "
            f"{spread_text(plain['tasks_per_s']['gateway'])} | |",
        ]
    return "\n".join(rows) + "\n"


def rewrite(text: str, name: str, body: str) -> str:
    """``text`` with what stands between the ``bench:NAME`` markers replaced by ``body``."""
    pattern = re.compile(rf"(<!-- bench:{re.escape(name)} -->\n)(.*?)(<!-- /bench:{re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no <!-- bench:{name} --> ... <!-- /bench:{name} --> markers")
    return pattern.sub(lambda m: m.group(1) + body + m.group(3), text, count=1)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench-docs", help="rewrite docs/benchmarks.md's tables from the benches' JSON",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", metavar="JSON", required=True,
                        help="the output of `gateway-dev bench --runs N --policies wfq --json`")
    parser.add_argument("--docs", default=str(DOCS), help="the page to rewrite (docs/benchmarks.md)")
    parser.add_argument("--where", default="", help="the machine, as the heading line says it "
                                                     "(default: cores, OS and Python of this one)")


def run(args: argparse.Namespace) -> int:
    result = json.loads(Path(args.router).read_text())
    page = Path(args.docs)
    page.write_text(rewrite(page.read_text(), "router", router_table(result, args.where or machine())))
    print(f"{page}: router table rewritten from {args.router}")
    return 0
