"""The Lua loader: one text per script (its named KEYS/ARGV positions, prelude + script
when its header asks, its parts spliced in), every script with a KEYS/ARGV header, the clock
and bucket maths only in the prelude."""

from __future__ import annotations

import hashlib
import re

import pytest

from gateway_tasks.core.scripts import (PRELUDE, USES_PRELUDE, available, body as script_body, file_text, layout,
                                        scripts_for, source, uses_prelude)

PRELUDE_FUNCTIONS = re.findall(r"^local function (gt_\w+)", file_text(PRELUDE), re.M)


def test_prelude_defines_the_shared_functions():
    assert {"gt_now_ms", "gt_refill", "gt_bucket", "gt_ring"} <= set(PRELUDE_FUNCTIONS)
    assert PRELUDE not in available()


@pytest.mark.parametrize("name", available())
def test_every_script_has_a_header_naming_its_keys_and_argv(name):
    lines = file_text(name).splitlines()
    if lines[0] == USES_PRELUDE:
        lines = lines[1:]
    assert lines[0].startswith(f"-- {name}.lua: ")
    header = "\n".join(line for line in lines if line.startswith("--"))
    assert "KEYS[1]" in header and "ARGV" in header


@pytest.mark.parametrize("name", available())
def test_a_script_using_the_prelude_says_so_and_is_loaded_after_it(name):
    body = script_body(name)
    uses = [f for f in PRELUDE_FUNCTIONS if f + "(" in body]
    assert uses_prelude(name) == bool(uses), uses
    if uses:
        assert source(name) == layout(name).lua() + file_text(PRELUDE) + "\n" + body
    else:
        assert source(name) == layout(name).lua() + body
    assert "redis.call('TIME')" not in body       # the clock is gt_now_ms()


def test_the_sha_is_the_loaded_text(r):
    scripts = scripts_for(r)
    assert scripts_for(r) is scripts
    for name in available():
        assert scripts.sha(name) == hashlib.sha1(source(name).encode()).hexdigest()
