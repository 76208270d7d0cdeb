"""The Lua loader: the one place that reads .lua files, computes SHAs and loads scripts.

The scripts are real .lua files shipped in the wheel (package ``gateway_tasks.lua``).
Each does one operation and starts with a header naming its KEYS and ARGV.  A
script whose first line is ``-- uses: prelude`` is loaded as ``prelude.lua``
followed by the script: one text, one SHA (see ``source``).

Callers never build KEYS/ARGV by hand: they pass a *call* (``ScriptCall``), a
small typed object that names its script, builds its KEYS and ARGV and parses
the reply.  ``scripts_for(client)`` gives the one ``Scripts`` registry of a
client, with three ways to run a call -- each survives a server that lost its
scripts (restart, SCRIPT FLUSH):

* ``run(call)``: EVALSHA now; after NOSCRIPT, SCRIPT LOAD and EVALSHA again;
* ``queue(call, pipe)``: EVALSHA in a pipeline; when the pipeline executes it
  first checks SCRIPT EXISTS and loads what is missing (redis-py's pipeline
  scripts), so the reply is ``call.parse(results[i])`` afterwards;
* ``command(call)``: the EVALSHA command for a caller that sends it on its own
  connection (the workers' event loop, ``workers.transport``); the script is
  loaded before the first command.  When that command's reply raises
  ``NoScriptError`` the caller calls ``lost()``: the next ``command`` loads
  the script again.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Any, ClassVar, Protocol, Sequence, TypeVar

import redis
from redis.commands.core import Script

LUA_PACKAGE = "gateway_tasks.lua"
PRELUDE = "prelude"
USES_PRELUDE = "-- uses: prelude"

Arg = str | bytes | int | float
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class ScriptCall(Protocol[R_co]):
    """One typed call of one script: its KEYS, its ARGV, and how to read its reply."""

    SCRIPT: ClassVar[str]  # the script's file name without .lua

    @property
    def script_keys(self) -> Sequence[str | bytes]: ...

    @property
    def script_args(self) -> Sequence[Arg]: ...

    def parse(self, reply: Any) -> R_co: ...


def text(value: bytes | str) -> str:
    """A script's string reply (bytes from a client without decode_responses)."""
    return value.decode() if isinstance(value, bytes) else str(value)


@lru_cache(maxsize=None)
def file_text(name: str) -> str:
    """The text of lua/<name>.lua as shipped."""
    return (resources.files(LUA_PACKAGE) / f"{name}.lua").read_text(encoding="utf-8")


def uses_prelude(name: str) -> bool:
    return file_text(name).split("\n", 1)[0].strip() == USES_PRELUDE


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """The text loaded into Redis for a script: the prelude first when its header asks."""
    body = file_text(name)
    return file_text(PRELUDE) + "\n" + body if uses_prelude(name) else body


def available() -> list[str]:
    """The names of every script (the prelude is not one)."""
    return sorted(p.name[:-4] for p in resources.files(LUA_PACKAGE).iterdir()
                  if p.name.endswith(".lua") and p.name != f"{PRELUDE}.lua")


class Scripts:
    """The scripts of one redis client, registered on first use."""

    def __init__(self, client: redis.Redis):
        self.client = client
        self._registered: dict[str, Script] = {}
        self._loaded: set[str] = set()   # known to be on the server (``command`` only)

    def _script(self, name: str) -> Script:
        found = self._registered.get(name)
        if found is None:
            found = self.client.register_script(source(name))
            self._registered[name] = found
        return found

    def sha(self, name: str) -> str:
        return self._script(name).sha

    def run(self, call: ScriptCall[R]) -> R:
        """Run a call now and parse its reply."""
        return call.parse(self._script(call.SCRIPT)(keys=call.script_keys, args=call.script_args))

    def queue(self, call: ScriptCall[Any], pipe: redis.client.Pipeline) -> None:
        """Add a call to a pipeline; parse its reply with ``call.parse`` after execute()."""
        self._script(call.SCRIPT)(keys=call.script_keys, args=call.script_args, client=pipe)

    def command(self, call: ScriptCall[Any]) -> tuple[Arg, ...]:
        """The EVALSHA command of a call, for ``connection.send_command(*command)``;
        loads the script first unless it is known to be on the server."""
        name = call.SCRIPT
        if name not in self._loaded:
            self.client.script_load(source(name))
            self._loaded.add(name)
        return self._evalsha(call)

    def _evalsha(self, call: ScriptCall[Any]) -> tuple[Arg, ...]:
        keys = call.script_keys
        return ("EVALSHA", self.sha(call.SCRIPT), len(keys), *keys, *call.script_args)

    def run_together(self, calls: Sequence[ScriptCall[Any]],
                     reads: Sequence[tuple[Arg, ...]] = ()) -> tuple[list[Any], list[Any]]:
        """Script calls and read-only commands in one round trip (one pipeline): the parsed
        replies of ``calls`` and the raw replies of ``reads``, in order.

        Each script runs exactly once: one the server had lost (NOSCRIPT: it did not run)
        is loaded and run alone, the others' replies stand; the reads are sent again after
        it, so they see it.  Any other error of a call is raised once every reply is in."""
        with self.client.pipeline(transaction=False) as pipe:
            for call in calls:
                pipe.execute_command(*self._evalsha(call))
            for command in reads:
                pipe.execute_command(*command)
            got = pipe.execute(raise_on_error=False)
        replies, lost = [], False
        for call, reply in zip(calls, got):
            if isinstance(reply, redis.exceptions.NoScriptError):
                self.lost()
                lost = True
                replies.append(self.run(call))
            elif isinstance(reply, Exception):
                raise reply
            else:
                replies.append(call.parse(reply))
        read = got[len(calls):]
        if lost:
            read = [self.client.execute_command(*command) for command in reads]
        return replies, read

    def lost(self) -> None:
        """A reply said NOSCRIPT: the server lost its scripts; ``command`` loads them again."""
        self._loaded.clear()


def scripts_for(client: redis.Redis) -> Scripts:
    """One Scripts registry per client object (scripts load once per client)."""
    found = getattr(client, "_gateway_scripts", None)
    if found is None:
        found = Scripts(client)
        client._gateway_scripts = found  # type: ignore[attr-defined]
    return found
