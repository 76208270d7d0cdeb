"""What a request's JSON may hold: a bounded nesting depth, strings that are valid
Unicode (no lone surrogates: they cannot be encoded as UTF-8) and finite numbers (NaN and
±Infinity are not JSON).  ``json_depth`` measures raw bytes without parsing them (the REST
body, before any parser recurses into it); ``check_value`` walks a parsed value without
recursion and raises InvalidRequest naming the first bad field by its path, e.g.
``extra_body.temperature: NaN is not valid JSON``."""

from __future__ import annotations

import math
import re
from itertools import accumulate
from typing import Any, Mapping

from gateway_tasks.core.errors import InvalidRequest

DEPTH_SETTING = "max_json_depth"
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')     # a JSON string, its escapes included
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(raw: bytes, limit: int) -> int:
    """The nesting depth of the JSON text ``raw`` (arrays and objects; brackets inside
    strings do not count), at most ``limit + 1`` (deeper is all one).  The strings are
    cut out and the brackets summed in C, not byte by byte; malformed text is measured all
    the same (the parser refuses it afterwards)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return min(limit + 1, max(accumulate(map(_STEP.__getitem__, brackets)), default=0))


def too_deep_message(limit: int) -> str:
    return f"JSON nesting is deeper than the limit of {limit} levels ({DEPTH_SETTING})"


def _child(path: str, key: Any) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)


def _lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_value(value: Any, path: str, max_depth: int) -> None:
    """Raise InvalidRequest unless ``value`` is JSON that can be sent on as UTF-8: nested
    at most ``max_depth`` levels below ``path``, no lone surrogate in a string or a key,
    no NaN or ±Infinity, nothing but dict, list, tuple, str, int, float, bool and None."""
    stack: list[tuple[Any, str, int]] = [(value, path, 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            if _lone_surrogate(item):
                raise InvalidRequest(f"{where}: lone surrogate (not valid Unicode)")
        elif isinstance(item, float):
            if not math.isfinite(item):
                name = "NaN" if math.isnan(item) else "Infinity" if item > 0 else "-Infinity"
                raise InvalidRequest(f"{where}: {name} is not valid JSON")
        elif isinstance(item, (Mapping, list, tuple)):
            if depth >= max_depth:
                raise InvalidRequest(f"{path}: {too_deep_message(max_depth)}")
            pairs = item.items() if isinstance(item, Mapping) else enumerate(item)
            children = []
            for key, child in pairs:
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise InvalidRequest(f"{where}: key {key!r} is not a string")
                if isinstance(key, str) and _lone_surrogate(key):
                    raise InvalidRequest(f"{_child(where, key.encode('utf-8', 'backslashreplace').decode())}"
                                         f": lone surrogate in the key (not valid Unicode)")
                children.append((child, _child(where, key), depth + 1))
            stack.extend(reversed(children))
        elif item is not None and not isinstance(item, (bool, int)):
            raise InvalidRequest(f"{where}: a {type(item).__name__} is not JSON")
