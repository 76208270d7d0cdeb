"""The Lua loader: the one place that reads .lua files, computes SHAs and loads scripts.

The scripts are real .lua files shipped in the wheel (package ``gateway_tasks.lua``), in
one folder per feature; a script is named by its path there (``dispatch/pick``).
Each does one operation and starts with a header naming its KEYS and ARGV.  A
script whose first line is ``-- uses: core/prelude`` is loaded as ``core/prelude.lua``
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
  connection (the workers' event loop, ``gateway_tasks.dispatch.transport``); the script is
  loaded before the first command.  When that command's reply raises
  ``NoScriptError`` the caller calls ``lost()``: the next ``command`` loads
  the script again.

KEYS and ARGV by name
---------------------
A script's header is its layout, the one place its KEYS and ARGV are defined: lines that
start ``-- KEYS[i]`` or ``-- ARGV[i]`` (``i`` the 1-based position, checked, or ``..``: the
position follows from what comes before; several items may share a line) declare, in order:

* ``name``: one value;  ``name?``: one value that may be left out, with all after it;
* ``name...``: every remaining value (a variable tail: pairs, field/value lists);
* ``per <group> (<count>): field field ...``: a record of those fields per <group> member,
  repeated ``count`` times, ``count`` being an ARGV value declared before it (a line ending
  with ``,`` goes on with more fields on the next).  A group may
  have records in both KEYS and ARGV (a pool's keys and its rates): one count, one record.

From it (``layout``) a call builds its KEYS and ARGV by name (``Layout.keys`` /
``Layout.args``; a count is filled in from its group), and the loader puts named positions
in front of the script's text (``Layout.lua``), so a script reads ``KEYS[K_bucket]``,
``ARGV[A_tag]``, and per record ``ARGV[a + A_queue_tier]`` with ``a = A_per_queue * (q - 1)``
-- local numbers, computed once: the same arithmetic as literal offsets.  Names: ``K_<key>``,
``A_<arg>``, ``K_<group>_<field>`` / ``A_<group>_<field>`` (the first record's position),
``K_per_<group>`` / ``A_per_<group>`` (positions per record), ``N_<group>`` (its count).

A script may also splice in parts of itself: a body line ``-- include: <script>/<part>`` is
replaced by ``lua/<script>/<part>.lua``, a part in the folder named after its script
(``dispatch/pick/scoring``: pick.lua's candidates, scoring, ...), so the parts share the
script's locals and load as one text with one SHA.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, ClassVar, Iterable, Mapping, Protocol, Sequence, TypeVar

import redis
from redis.cluster import ClusterPipeline
from redis.commands.core import Script

LUA_PACKAGE = "gateway_tasks.lua"
PRELUDE = "core/prelude"
USES_PRELUDE = f"-- uses: {PRELUDE}"
INCLUDE = re.compile(r"^-- include: ([\w/]+)$", re.M)

Arg = str | bytes | int | float
# a cluster master's refusals of a command it did not run: it may be sent again
NOT_RUN = (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError)
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
    """The text of lua/<name>.lua as shipped (``name`` has its folder: ``dispatch/pick``, a part
    ``dispatch/pick/scoring``)."""
    node = resources.files(LUA_PACKAGE)
    for step in f"{name}.lua".split("/"):
        node = node / step
    return node.read_text(encoding="utf-8")


def uses_prelude(name: str) -> bool:
    return file_text(name).split("\n", 1)[0].strip() == USES_PRELUDE


def includes(name: str) -> list[str]:
    """The parts a script (or part) splices in, in order, theirs included."""
    out: list[str] = []
    for part in INCLUDE.findall(file_text(name)):
        out += [part, *includes(part)]
    return out


def body(name: str) -> str:
    """A script's own text with its parts spliced in where its include lines stand."""
    return INCLUDE.sub(lambda m: body(m.group(1)).rstrip("\n"), file_text(name))


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """The text loaded into Redis for a script: its named KEYS/ARGV positions (generated from
    its header), the prelude when its header asks, then the script with its parts."""
    prelude = file_text(PRELUDE) + "\n" if uses_prelude(name) else ""
    return layout(name).lua() + prelude + body(name)


def available() -> list[str]:
    """The names of every script: its path under lua/ without .lua (``dispatch/pick``).  Not
    the prelude, nor a script's parts (the files of the folder named after it: lua/dispatch/pick/)."""
    found: list[str] = []

    def walk(node: Any, folder: str) -> None:
        for child in node.iterdir():
            if child.is_dir():
                walk(child, f"{folder}{child.name}/")
            elif child.name.endswith(".lua"):
                found.append(folder + child.name[:-4])

    walk(resources.files(LUA_PACKAGE), "")
    names = set(found)
    return sorted(n for n in found if n != PRELUDE and n.rpartition("/")[0] not in names)


# -- layouts ------------------------------------------------------------------------------

LAYOUT_LINE = re.compile(r"^--\s+(?:KEYS|ARGV)\[")
LAYOUT_ITEM = re.compile(r"(?:^--\s+|\s)(KEYS|ARGV)\[(\d+|\.\.)\]\s+(.*?)(?=\s+(?:KEYS|ARGV)\[|$)")
GROUP_ITEM = re.compile(r"^per (\w+) \((\w+)\):\s*([\w ,]+)$")
VALUE_ITEM = re.compile(r"^(\w+)(\?|\.\.\.)?(?:\s|:|$)")
ONE, OPTIONAL, REST, GROUP = "one", "optional", "rest", "group"


class LayoutError(ValueError):
    """A header's layout is malformed, or a call does not fit it."""


@dataclass(frozen=True)
class Item:
    """One declared KEYS or ARGV item: a value, an optional value, the rest, or a group."""

    name: str
    kind: str = ONE
    fields: tuple[str, ...] = ()   # GROUP: the fields of each record
    count: str = ""                # GROUP: the ARGV value holding its number of records


def _items(name: str, section: str) -> tuple[Item, ...]:
    """The items of one section (KEYS or ARGV) of a script's header, positions checked."""
    out: list[Item] = []
    static: int | None = 1   # the next position while it does not depend on a count
    lines = header(name)
    for n, line in enumerate(lines):
        if not LAYOUT_LINE.match(line):
            continue
        for found in LAYOUT_ITEM.finditer(line):
            if found.group(1) != section:
                continue
            at, text = found.group(2), found.group(3)
            following = iter(lines[n + 1:])
            while text.startswith("per ") and text.endswith(","):   # a group's fields go on
                text = text[:-1] + " " + next(following, "--").lstrip("- ")
            if at != ".." and (static is None or int(at) != static):
                raise LayoutError(f"{name}.lua: {section}[{at}] {text!r} is at position {static or '..'}")
            group = GROUP_ITEM.match(text)
            if group:
                fields = tuple(re.findall(r"\w+", group.group(3)))
                item = Item(group.group(1), GROUP, fields, group.group(2))
                static = None
            else:
                value = VALUE_ITEM.match(text)
                if not value:
                    raise LayoutError(f"{name}.lua: {section}[{at}] {text!r} names no item")
                kind = {"?": OPTIONAL, "...": REST}.get(value.group(2) or "", ONE)
                item = Item(value.group(1), kind)
                static = None if static is None or kind == REST else static + 1
            if out and out[-1].kind == REST:
                raise LayoutError(f"{name}.lua: {section} {item.name!r} after the rest ({out[-1].name})")
            if out and out[-1].kind == OPTIONAL and item.kind != OPTIONAL:
                raise LayoutError(f"{name}.lua: {section} {item.name!r} after an optional item")
            out.append(item)
    return tuple(out)


def header(name: str) -> list[str]:
    """A script's header: its comment lines before the first line of code."""
    out = []
    for line in file_text(name).splitlines():
        if not line.startswith("--"):
            break
        out.append(line)
    return out


@dataclass(frozen=True)
class Layout:
    """A script's KEYS and ARGV, by name (from its header: ``layout``)."""

    script: str
    keys_items: tuple[Item, ...]
    args_items: tuple[Item, ...]

    def __post_init__(self) -> None:
        scalars = {i.name for i in self.args_items if i.kind == ONE}
        counts: dict[str, str] = {}
        for item in (*self.keys_items, *self.args_items):
            if item.kind != GROUP:
                continue
            if item.count not in scalars or counts.setdefault(item.name, item.count) != item.count:
                raise LayoutError(f"{self.script}.lua: group {item.name!r} counts by {item.count!r}: "
                                  f"one ARGV value declared before it, the same in KEYS and ARGV")
        for at, item in enumerate(self.args_items):
            if item.kind == GROUP and item.count not in {i.name for i in self.args_items[:at]}:
                raise LayoutError(f"{self.script}.lua: ARGV {item.count!r} comes after its group {item.name!r}")
        both = {i.name for i in self.keys_items} & {i.name for i in self.args_items}
        if any(i.kind != GROUP for i in (*self.keys_items, *self.args_items) if i.name in both):
            raise LayoutError(f"{self.script}.lua: {sorted(both)} named in KEYS and in ARGV (only a group may be)")
        names = self.lua_names()
        if len(names) != len(set(names)):
            raise LayoutError(f"{self.script}.lua: a name is declared twice: {sorted(names)}")

    def keys(self, **named: Any) -> list[Any]:
        """KEYS by name: a value per item, a sequence of records (mappings) per group."""
        return self._build(self.keys_items, named, "KEYS")

    def args(self, **named: Any) -> list[Any]:
        """ARGV by name, as ``keys``; a group's count may be left out (its records say it)."""
        for item in (*self.args_items, *self.keys_items):
            if item.kind != GROUP or item.name not in named:
                continue
            records = len(named[item.name])
            if named.setdefault(item.count, records) != records:
                raise LayoutError(f"{self.script}.lua: {item.count} = {named[item.count]} but "
                                  f"{records} records per {item.name}")
        return self._build(self.args_items, named, "ARGV")

    def _build(self, items: tuple[Item, ...], named: Mapping[str, Any], section: str) -> list[Any]:
        known = {i.name for i in items}
        unknown = set(named) - known - self._other_names(section)
        if unknown:
            raise LayoutError(f"{self.script}.lua declares no {section} {sorted(unknown)}")
        out: list[Any] = []
        left_out = ""
        for item in items:
            if item.name not in named or (item.kind == OPTIONAL and named[item.name] is None):
                if item.kind == ONE:
                    raise LayoutError(f"{self.script}.lua: {section} {item.name!r} is missing")
                left_out = left_out or item.name
                continue
            if left_out:
                raise LayoutError(f"{self.script}.lua: {section} {item.name!r} given after {left_out!r} left out")
            value = named[item.name]
            if item.kind == ONE or item.kind == OPTIONAL:
                out.append(value)
            elif item.kind == REST:
                out += list(value)
            else:
                out += self._records(item, value, section)
        return out

    def _records(self, item: Item, records: Iterable[Mapping[str, Any]], section: str) -> list[Any]:
        out: list[Any] = []
        for record in records:
            try:
                out += [record[f] for f in item.fields]
            except KeyError as missing:
                raise LayoutError(f"{self.script}.lua: {section} per {item.name}: no {missing}") from None
        return out

    def read(self, keys: Sequence[Any], args: Sequence[Any]) -> dict[str, Any]:
        """KEYS and ARGV as built, by name again (groups as lists of records, a group in both
        sections merged): what the script sees.  LayoutError when they do not fit the layout
        -- a value missing, one too many, a group's records not as many as its count says."""
        named = self._read(self.args_items, list(args), {}, "ARGV")
        named_keys = self._read(self.keys_items, list(keys), named, "KEYS")
        for name, value in named_keys.items():
            if name in named:   # a group in both sections: one record each
                named[name] = [{**a, **k} for a, k in zip(named[name], value)]
            else:
                named[name] = value
        return named

    def _read(self, items: tuple[Item, ...], values: list[Any], counts: Mapping[str, Any],
              section: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        at = 0
        for item in items:
            if item.kind == REST:
                out[item.name], at = values[at:], len(values)
            elif item.kind == GROUP:
                n = int(out.get(item.count, counts.get(item.count, 0)))
                end = at + n * len(item.fields)
                if end > len(values):
                    raise LayoutError(f"{self.script}.lua: {section} ends inside per {item.name} "
                                      f"({item.count} = {n})")
                out[item.name] = [dict(zip(item.fields, values[i:i + len(item.fields)]))
                                  for i in range(at, end, len(item.fields))]
                at = end
            elif at < len(values):
                out[item.name], at = values[at], at + 1
            elif item.kind == ONE:
                raise LayoutError(f"{self.script}.lua: {section} has no {item.name!r}")
        if at != len(values):
            raise LayoutError(f"{self.script}.lua: {section} has {len(values) - at} values past its layout")
        return out

    def _other_names(self, section: str) -> set[str]:
        """Names of the other section a caller may pass to both (a group's records, counts)."""
        other = self.args_items if section == "KEYS" else self.keys_items
        return {i.name for i in other} | {i.count for i in other if i.kind == GROUP}

    def groups(self) -> dict[str, str]:
        """group -> the ARGV value counting its records."""
        return {i.name: i.count for i in (*self.keys_items, *self.args_items) if i.kind == GROUP}

    def lua_names(self) -> list[str]:
        """The names ``lua`` defines, in order."""
        return [name for name, _ in self._lua_defs()]

    def field_names(self) -> list[str]:
        """The names of the declared values themselves (no strides or counts): each one is read
        by the script."""
        out = []
        for prefix, items in (("A", self.args_items), ("K", self.keys_items)):
            for item in items:
                if item.kind == GROUP:
                    out += [f"{prefix}_{item.name}_{f}" for f in item.fields]
                elif item.name not in self.groups().values():
                    out.append(f"{prefix}_{item.name}")
        return out

    def _lua_defs(self) -> list[tuple[str, str]]:
        defs: list[tuple[str, str]] = []
        counted: set[str] = set()
        for prefix, items in (("A", self.args_items), ("K", self.keys_items)):
            static, base = 1, ""    # the next position: base (a Lua expression) + static
            for item in items:
                at = f"{base} + {static}" if base and static else (base or str(static))
                if item.kind != GROUP:
                    defs.append((f"{prefix}_{item.name}", at))
                    static += 1
                    continue
                if item.name not in counted:
                    counted.add(item.name)
                    defs.append((f"N_{item.name}", f"tonumber(ARGV[A_{item.count}])"))
                first, per = f"{prefix}_{item.name}_{item.fields[0]}", f"{prefix}_per_{item.name}"
                defs += [(per, str(len(item.fields))), (first, at)]
                defs += [(f"{prefix}_{item.name}_{f}", f"{first} + {i}") for i, f in enumerate(item.fields) if i]
                base, static = f"{first} + {per} * N_{item.name}", 0
        return defs

    def lua(self) -> str:
        """The named positions as Lua locals, put in front of the script's text."""
        lines = [f"-- {self.script}.lua's KEYS and ARGV positions by name, from its header "
                 f"(gateway_tasks/core/scripts.py)"]
        lines += [f"local {name} = {expr}" for name, expr in self._lua_defs()]
        return "\n".join(lines) + "\n"


@lru_cache(maxsize=None)
def layout(name: str) -> Layout:
    """A script's KEYS and ARGV layout, read from its header."""
    return Layout(name, _items(name, "KEYS"), _items(name, "ARGV"))


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
        """Add a call to a pipeline; parse its reply with ``call.parse`` after execute().  A
        Redis Cluster's pipeline does not load its scripts as a server's does: the first call
        of each script queued in it checks that every master has it (SCRIPT EXISTS) and loads
        it where missing, as a server's pipeline checks before it executes."""
        script = self._script(call.SCRIPT)
        if isinstance(pipe, ClusterPipeline):
            checked = pipe.__dict__.setdefault("_gateway_scripts_checked", set())
            if script.sha not in checked:
                if not all(self.client.script_exists(script.sha)):
                    self.client.script_load(script.script)
                checked.add(script.sha)
        script(keys=call.script_keys, args=call.script_args, client=pipe)

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
        it, so they see it.  On a Redis Cluster the calls go to their slots' masters, and
        one a master refused without running it (CLUSTERDOWN while it rejoins after a
        restart, TRYAGAIN while its slot migrates) is run alone the same way, through the
        client's retries, and the reads are sent again.  Any other error of a call or a read
        is raised once every reply is in."""
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
            elif isinstance(reply, NOT_RUN):
                lost = True
                replies.append(self.run(call))
            elif isinstance(reply, Exception):
                raise reply
            else:
                replies.append(call.parse(reply))
        read = got[len(calls):]
        if lost or any(isinstance(reply, NOT_RUN) for reply in read):
            read = [self.client.execute_command(*command) for command in reads]
        failed = next((reply for reply in read if isinstance(reply, Exception)), None)
        if failed is not None:
            raise failed
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
