"""The ``gateway api`` command: serve the REST trigger with uvicorn."""

from __future__ import annotations

import argparse
from typing import Any

from gateway_tasks.core.config_report import announce
from gateway_tasks.core.settings import Settings, get_settings
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.rest.app import create_app


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the API with uvicorn (one process; scale out with replicas)."""
    import uvicorn

    settings.require_redis_url("the REST API")
    announce(settings, "api")
    uvicorn.run(create_app(Gateway(settings)), host=host, port=port)


def _run(args: argparse.Namespace) -> int:
    serve(get_settings(), args.host, args.port)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``api`` command to the ``gateway`` CLI."""
    parser = subparsers.add_parser(
        "api", help="serve the REST API (submit tasks, read results, OpenAI-compatible endpoint)",
        description="Serve the gateway's REST API with uvicorn. Reads REDIS_URL and "
                    "GATEWAY_CONFIG like the workers.")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default %(default)s)")
    parser.set_defaults(func=_run)
