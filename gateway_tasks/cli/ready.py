"""`gateway ready`: wait until a deployment answers -- Redis, N workers, HTTP endpoints.

For scripts, init containers and the README's walk-through: it returns 0 as
soon as everything asked for answers, or 1 with what did not after --timeout-s.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import httpx

from gateway_tasks.core.celery_app import make_app
from gateway_tasks.core.redis_client import connect
from gateway_tasks.core.redis_failures import CLIENT_ERRORS
from gateway_tasks.core.settings import get_settings
from gateway_tasks.core.urls import without_credentials

POLL_S = 0.25


def _redis_ok(url: str) -> bool:
    """Whether the Redis at ``url`` answers (a cluster: its slots are all served)."""
    try:
        client = connect(url, socket_connect_timeout=1)
    except (*CLIENT_ERRORS, OSError):
        return False
    try:
        return bool(client.ping())
    except (*CLIENT_ERRORS, OSError):
        return False
    finally:
        client.close()


def _url_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


def wait_ready(*, workers: int, urls: list[str], timeout_s: float) -> list[str]:
    """Wait for everything; returns what is still not answering (empty: ready)."""
    settings = get_settings()
    settings.require_redis_url("`gateway ready`")
    deadline = time.monotonic() + timeout_s
    app = None
    while True:
        missing = []
        down = [u for u in (settings.redis_url, settings.control_redis_url) if u and not _redis_ok(u)]
        if down:
            missing += [f"Redis at {without_credentials(u)}" for u in down]
        elif workers:
            app = app or make_app(settings)
            seen = len(app.control.ping(timeout=0.5) or [])
            if seen < workers:
                missing.append(f"workers: {seen} of {workers} answer")
        missing += [f"{u} does not answer" for u in urls if not _url_ok(u)]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(POLL_S)


def _run(args: argparse.Namespace) -> int:
    missing = wait_ready(workers=args.workers, urls=args.url, timeout_s=args.timeout_s)
    if missing:
        print(f"not ready after {args.timeout_s:g} s: " + "; ".join(missing), file=sys.stderr)
        return 1
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "ready", help="wait until Redis, workers and HTTP endpoints answer",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=0, help="how many workers must answer a ping")
    parser.add_argument("--url", action="append", default=[],
                        help="an HTTP URL that must answer (any status below 500); repeatable")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="give up after (default %(default)s)")
    parser.set_defaults(func=_run)
