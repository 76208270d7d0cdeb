"""Lua scripts: real .lua files shipped in the wheel, loaded once per client.

Each file does one operation and starts with a header naming its KEYS and
ARGV.  ``Scripts(client)`` registers every script on that client (EVALSHA,
falling back to EVAL/SCRIPT LOAD after a NOSCRIPT, as redis-py does).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Any

import redis

LUA_PACKAGE = "gateway_tasks.lua"


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """The text of lua/<name>.lua."""
    return (resources.files(LUA_PACKAGE) / f"{name}.lua").read_text(encoding="utf-8")


def available() -> list[str]:
    return sorted(p.name[:-4] for p in resources.files(LUA_PACKAGE).iterdir()
                  if p.name.endswith(".lua"))


class Scripts:
    """Lazily registered scripts of one redis client: ``Scripts(r).pick(keys, args)``."""

    def __init__(self, client: redis.Redis):
        self.client = client
        self._cache: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        script = self._cache.get(name)
        if script is None:
            script = self.client.register_script(source(name))
            self._cache[name] = script
        return script

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.get(name)

    def sha(self, name: str) -> str:
        return self.get(name).sha


def scripts_for(client: redis.Redis) -> Scripts:
    """One Scripts registry per client object (scripts load once per client)."""
    found = getattr(client, "_gateway_scripts", None)
    if found is None:
        found = Scripts(client)
        client._gateway_scripts = found  # type: ignore[attr-defined]
    return found
