"""`gateway flower`: Flower on loopback, always behind basic auth.

Flower has no authentication of its own unless it is given one, and its pages
control workers (shutdown, pool resize, revoke).  This command starts it with
safe defaults: it listens on 127.0.0.1 unless told otherwise, and it always
requires HTTP basic auth -- ``FLOWER_BASIC_AUTH=user:password`` from the
environment, or a generated password printed once at start.

Flower runs on its own app (``celery -A gateway_tasks.cli.flower flower``): the
deployment's configuration on kombu's stock Redis transport (Flower knows Redis
URLs, not the gateway transport's).  Its broker page counts Redis lists, and a
gateway queue is no list (a tier's queued tasks are a sorted set among its pool's
keys), so it shows gateway queues as empty: their depth is in `gateway status`
and in the metrics (``gateway_queue_depth_messages``).  Flower only watches and inspects;
it enqueues nothing.
It has no result backend (a task's result is its tenant's data, read through the
REST API by its owner), and the workers' task events carry no result
(workers.redaction) and no prompt (the arguments are a summary).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from typing import Any, Mapping

from gateway_tasks.core.celery_app import lazy_app, make_app
from gateway_tasks.core.config_report import announce
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.settings import get_settings

FLOWER_APP = "gateway_tasks.cli.flower"
DEFAULT_ADDRESS = "127.0.0.1"
DEFAULT_PORT = 5555
DEFAULT_USER = "admin"
AUTH_ENV = "FLOWER_BASIC_AUTH"


def generated_basic_auth(user: str = DEFAULT_USER) -> str:
    """A fresh ``user:password`` (the password 24 URL-safe characters)."""
    return f"{user}:{secrets.token_urlsafe(18)}"


def basic_auth_from(env: Mapping[str, str]) -> tuple[str, bool]:
    """(user:password, generated?): FLOWER_BASIC_AUTH when it is set, else a new one."""
    value = env.get(AUTH_ENV, "").strip()
    if value:
        if ":" not in value.split(",")[0]:
            raise ConfigError(f"{AUTH_ENV} must be user:password (comma-separated for several users)")
        return value, False
    return generated_basic_auth(), True


def first_credentials(basic_auth: str) -> tuple[str, str]:
    """(user, password) of the first user of a FLOWER_BASIC_AUTH value."""
    user, _, password = basic_auth.split(",")[0].partition(":")
    return user, password


def flower_argv(*, address: str = DEFAULT_ADDRESS, port: int = DEFAULT_PORT) -> list[str]:
    """The command line of a Flower process for this deployment (auth comes from the env)."""
    return [sys.executable, "-m", "celery", "-A", FLOWER_APP, "flower",
            f"--address={address}", f"--port={port}"]


def flower_env(basic_auth: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env[AUTH_ENV] = basic_auth
    env.pop("FLOWER_UNAUTHENTICATED_API", None)  # the API stays behind the same auth
    return env


def _run(args: argparse.Namespace) -> int:
    settings = get_settings()
    settings.require_redis_url("`gateway flower`")   # a bad configuration: one line, here
    announce(settings, "flower")
    auth, generated = basic_auth_from(os.environ)
    user, password = first_credentials(auth)
    where = f"http://{args.address}:{args.port}"
    if generated:
        print(f"Flower at {where}  user {user}  password {password}  (generated; set {AUTH_ENV} "
              f"to choose your own)", file=sys.stderr, flush=True)
    else:
        print(f"Flower at {where}  (basic auth from {AUTH_ENV})", file=sys.stderr, flush=True)
    argv = flower_argv(address=args.address, port=args.port)
    os.execve(argv[0], argv, flower_env(auth))
    return 0  # not reached


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "flower", help="start Flower (loopback only, basic auth always on)",
        description="Start Flower for this deployment (reads REDIS_URL and GATEWAY_CONFIG like the "
                    f"workers). It listens on {DEFAULT_ADDRESS} unless --address says otherwise and "
                    f"always asks for HTTP basic auth: {AUTH_ENV}=user:password, or a generated "
                    "password printed at start.")
    parser.add_argument("--address", default=DEFAULT_ADDRESS,
                        help="interface to listen on (default %(default)s; 0.0.0.0 exposes it)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (default %(default)s)")
    parser.set_defaults(func=_run)


def protect_open_routes() -> None:
    """Flower serves ``/metrics`` (task names and counts, worker host names) and
    ``/healthcheck`` without asking for its auth (their handlers lack tornado's
    ``authenticated``); give them the same credentials check as every other page.  A
    Prometheus scrape passes them as ``basic_auth``; the Kubernetes readiness probe checks
    the TCP port (deploy/k8s/base/flower.yaml: a probe cannot send a Secret's value)."""
    from tornado.web import authenticated
    from flower.views import monitor

    for handler in (monitor.Metrics, monitor.Healthcheck):
        if not getattr(handler.get, "gateway_protected", False):
            protected = authenticated(handler.get)
            protected.gateway_protected = True      # type: ignore[attr-defined]
            handler.get = protected


def _flower_app() -> Any:
    protect_open_routes()     # this app is loaded by the Flower process (celery -A ... flower)
    # no result backend: Flower's /api/task/result would otherwise show tenants' completions
    return make_app(get_settings(), name="gateway-flower", transport="redis", result_backend="disabled")


flower_app, __getattr__ = lazy_app(_flower_app, "gateway flower")
