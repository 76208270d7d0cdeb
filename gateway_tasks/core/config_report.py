"""Which configuration a process runs on, said once at its start (worker, beat,
`gateway api`, `gateway flower`) and by `gateway status`: where its settings were
loaded from (``Settings.config_source``: the GATEWAY_CONFIG file, GATEWAY_SETTINGS_JSON
or the built-in defaults, and GATEWAY_POOLS_JSON when it replaced the pools) and each
pool's name and base URL, credentials stripped.  A worker's line also says whether each
pool's API key is present in its environment; no line ever holds a key."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from gateway_tasks.core.settings import Pool, Settings
from gateway_tasks.core.urls import without_credentials

BUILT_IN_CODE = "settings built in code"   # a Settings not made by load_settings


def source_of(settings: Settings) -> str:
    return settings.config_source or BUILT_IN_CODE


def pool_text(pool: Pool, *, keys: bool = False) -> str:
    """``pool NAME BASE_URL``, and with ``keys`` whether its key is here (never the key)."""
    text = f"pool {pool.name} {without_credentials(pool.base_url)}"
    if not keys:
        return text
    if pool.api_key:
        return f"{text} (key present)"
    missing = f"{pool.api_key_env} is not set" if pool.api_key_env else "no api_key or api_key_env"
    return f"{text} (no key: {missing})"


def config_line(settings: Settings, process: str, *, keys: bool = False) -> str:
    """One line: ``<process> configuration: <source>; pool <name> <url> ...``."""
    pools = "; ".join(pool_text(p, keys=keys) for p in settings.pools)
    return f"{process} configuration: {source_of(settings)}; {pools}"


def announce(settings: Settings, process: str, *, keys: bool = False, stream: TextIO | None = None) -> None:
    """Write ``config_line`` to stderr: a process says it whatever its log level."""
    print(config_line(settings, process, keys=keys), file=stream or sys.stderr, flush=True)


def config_summary(settings: Settings) -> dict[str, Any]:
    """The same as JSON (`gateway status --json`)."""
    return {"source": source_of(settings),
            "pools": [{"name": p.name, "base_url": without_credentials(p.base_url)} for p in settings.pools]}


def format_config(summary: dict[str, Any]) -> list[str]:
    """``config_summary`` as text lines for a terminal."""
    return [f"configuration: {summary['source']}",
            *(f"  pool {p['name']} {p['base_url']}" for p in summary["pools"])]
