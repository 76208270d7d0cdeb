"""Dependencies between tasks (``depends_on``), Redis side, and their release.

A task submitted with ``depends_on=[ids]`` is held -- not queued, so it takes no
queue space and no tokens -- until every task it names has finished.  Whatever ends a
task -- the worker (success, any failure), a cancel, an eviction -- calls ``finish``: the
last dependency to finish sends the held task on its way (``send`` below: the Celery
message it would have been at submit).  A dependency that did not succeed fails its
dependents with ``DependencyFailed`` instead.

Each task's records live under its own hash tag (``Keys.task_tag``), so on Redis Cluster
the tasks spread over the shards and no script crosses a slot; what spans tasks is a
sequence of single-slot scripts, exact under concurrency and crashes:

* holding (``hold``, then ``unguard``): the held record first, pending = its dependencies
  + 1, the guard (lua/lifecycle/depend.lua); then each dependency, in its own slot, either
  takes the task among its waiters or, finished already, says how it ended
  (lua/lifecycle/deps_join.lua) and the submit counts it down; the guard is counted down
  last.  Nothing releases the task before the guard goes, and a submit cut short leaves a
  record nobody releases: it expires;
* finishing (``finish``): lua/lifecycle/deps_done.lua marks the task done -- in the slot
  where deps_join.lua reads the mark, so each (dependency, dependent) pair is counted by
  exactly one side -- and says who waits; each waiter is counted down in its own slot
  (lua/lifecycle/deps_release.lua, once per pair however often it is asked: a retried or
  doubled end counts nothing twice), and the waiters set is deleted last.

While a held task of a higher tier waits on a lower tier's, the tasks down its chain are
dispatched at the higher tier's priority, charged to their own tenant, and never evicted
(``gateway_tasks.lifecycle.inherit``); when a task ends, what it lent is taken back.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import redis
from celery import Celery, states

from gateway_tasks.core.celery_app import settings_of
from gateway_tasks.core.errors import DependencyFailed, GatewayError
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import layout, scripts_for, text
from gateway_tasks.dispatch.message import send_infer
from gateway_tasks.lifecycle import inherit

logger = logging.getLogger(__name__)
OK, FAILED = "ok", "failed"
MAX_DEPENDENCIES = 32
# a finished task's done mark only bridges the moment between its end (its waiters are
# released) and its result being stored: a dependent submitted later sees the result
DONE_MARK_TTL_S = 300


@dataclass(frozen=True)
class DependCall:
    """lua/lifecycle/depend.lua: the held record of a task waiting on ``depends_on``, guarded."""

    SCRIPT: ClassVar[str] = "lifecycle/depend"

    keys: Keys
    task_id: str
    depends_on: tuple[str, ...]
    send_json: str
    ttl_ms: int
    tier: str = ""      # the tier the task waits at (its effective tier), lent down its chain

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(held=self.keys.held(self.task_id))

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(send=self.send_json, ttl_ms=self.ttl_ms, tier=self.tier,
                                        deps=self.depends_on)

    def parse(self, reply: Any) -> int:
        return int(reply)


@dataclass(frozen=True)
class DepsJoinCall:
    """lua/lifecycle/deps_join.lua: ``dependent`` waits on ``dependency`` -- or learns how it
    ended ('' joined, else OK | FAILED)."""

    SCRIPT: ClassVar[str] = "lifecycle/deps_join"

    keys: Keys
    dependency: str
    dependent: str
    ttl_ms: int

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(done=self.keys.done(self.dependency),
                                        waiters=self.keys.waiters(self.dependency))

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(dependent=self.dependent, ttl_ms=self.ttl_ms)

    def parse(self, reply: Any) -> str:
        return text(reply)


@dataclass(frozen=True)
class Done:
    """What deps_done.lua did: the outcome it marked, the tasks waiting on it, how many tasks
    it lends its tier to (``gateway_tasks.lifecycle.inherit``: taken back at its end)."""

    outcome: str
    waiting: tuple[str, ...]
    lent: int = 0


@dataclass(frozen=True)
class DepsDoneCall:
    SCRIPT: ClassVar[str] = "lifecycle/deps_done"
    keys: Keys
    task_id: str
    outcome: str
    ttl_ms: int
    check_cancelled: bool = False   # a cancel mark on the task makes the outcome 'failed'

    @property
    def script_keys(self) -> list[str]:
        k, t = self.keys, self.task_id
        return layout(self.SCRIPT).keys(done=k.done(t), waiters=k.waiters(t), lifted=k.lifted(t), lift=k.lift(t),
                                        cancelled=k.cancelled(t) if self.check_cancelled else None)

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(outcome=self.outcome, ttl_ms=self.ttl_ms)

    def parse(self, reply: Any) -> Done:
        return Done(text(reply[0]), tuple(text(x) for x in reply[1]), int(reply[2]))


def done_call(keys: Keys, task_id: str) -> DepsDoneCall:
    """deps_done.lua marking a task that succeeded -- failed, if it was cancelled -- in the
    worker's settle round trip, nobody counted down yet: ``finish(..., done=its reply)`` at the
    task's end needs no round trip when nobody waits and the end is the outcome marked; a
    worker that dies in between leaves the waiters for the task's rerun."""
    return DepsDoneCall(keys, task_id, OK, DONE_MARK_TTL_S * 1000, check_cancelled=True)


@dataclass(frozen=True)
class Released:
    send: dict[str, Any]
    failed: str


@dataclass(frozen=True)
class DepsReleaseCall:
    """lua/lifecycle/deps_release.lua: ``dependency`` (the dependent's own id: its guard) is
    counted down on ``dependent``'s held record, once."""

    SCRIPT: ClassVar[str] = "lifecycle/deps_release"

    keys: Keys
    dependent: str
    dependency: str
    outcome: str

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(held=self.keys.held(self.dependent))

    @property
    def script_args(self) -> list[str]:
        return layout(self.SCRIPT).args(outcome=self.outcome, dependency=self.dependency)

    def parse(self, reply: Any) -> Released | None:
        if int(reply[0]) == 0:
            return None
        return Released(json.loads(text(reply[1])), text(reply[2]))


def hold(client: redis.Redis, keys: Keys, task_id: str, deps: Sequence[str], send_json: str, ttl_ms: int,
         tier: str) -> tuple[str, ...]:
    """Hold a task on ``deps``, its guard kept (``unguard`` takes it back): its held record, then
    each dependency joined in its own slot -- one that has finished already is counted down
    here, with its outcome.  Returns the ids it waits on (a dependency's end releases it)."""
    scripts = scripts_for(client)
    scripts.run(DependCall(keys, task_id, tuple(deps), send_json, ttl_ms, tier))
    marks, _ = scripts.run_together([DepsJoinCall(keys, dep, task_id, ttl_ms) for dep in deps])
    ended = [(dep, mark) for dep, mark in zip(deps, marks) if mark]
    if ended:
        scripts.run_together([DepsReleaseCall(keys, task_id, dep, mark) for dep, mark in ended])
    return tuple(dep for dep, mark in zip(deps, marks) if not mark)


def unguard(client: redis.Redis, keys: Keys, task_id: str) -> Released | None:
    """The last step of ``hold``: its guard counted down.  The released task's instructions when
    every dependency had finished meanwhile (the caller sends it, or fails it when one did not
    succeed), else None: a dependency's end releases it."""
    return scripts_for(client).run(DepsReleaseCall(keys, task_id, task_id, OK))


def send_spec(task_id: str, queue: str, body: dict[str, Any], headers: dict[str, Any], argsrepr: str) -> str:
    """How to send a held task later (JSON: no pickle, no secrets -- what its message holds)."""
    return json.dumps({"task_id": task_id, "queue": queue, "body": body, "headers": headers,
                       "argsrepr": argsrepr})


def send(app: Celery, client: redis.Redis, spec: dict[str, Any]) -> None:
    """Send a task as ``Gateway.submit`` would have (one gateway.infer message)."""
    send_infer(app, client, spec["task_id"], spec["queue"], spec["body"], spec["headers"], spec["argsrepr"])


def finish(app: Celery, client: redis.Redis, keys: Keys, ttl_s: int, task_id: str, ok: bool,
           done: Done | None = None) -> int:
    """A task has finished: release the held tasks that were waiting on it and on nothing
    else now.  Returns how many were released (sent, or failed for a failed dependency).

    ``done``: the reply of ``done_call``, which marked the task in the worker's settle round
    trip: when that is the end's outcome, nobody waits and it lends nothing, nothing is left
    to do."""
    outcome = OK if ok else FAILED
    if done is not None and done.outcome == outcome and not done.waiting and not done.lent:
        return 0
    scripts = scripts_for(client)
    released = 0
    marked = scripts.run(DepsDoneCall(keys, task_id, outcome, DONE_MARK_TTL_S * 1000))
    if marked.lent:
        settings = settings_of(app)
        inherit.withdraw(client, keys, settings, [p.name for p in settings.pools], task_id)
    for dependent in marked.waiting:
        got = scripts.run(DepsReleaseCall(keys, dependent, task_id, marked.outcome))
        if got is None:
            continue
        released += 1
        release(app, client, keys, ttl_s, got.send, got.failed)
    if marked.waiting:      # each counted down: the set goes (a finish cut short leaves it)
        client.delete(keys.waiters(task_id))
    return released


def release(app: Celery, client: redis.Redis, keys: Keys, ttl_s: int, spec: dict[str, Any],
            failed: str) -> None:
    """Send a released task, or fail it when a dependency did not succeed (which ends it:
    its own dependents are released in turn)."""
    task_id = spec["task_id"]
    if failed:
        app.backend.store_result(task_id, DependencyFailed(
            f"task {task_id} depends on task {failed}, which did not succeed; it was not run",
            None, "dependency_failed"), states.FAILURE)
        finish(app, client, keys, ttl_s, task_id, ok=False)
        return
    try:
        send(app, client, spec)
    except GatewayError as exc:        # the queue refused it now: that is its end
        logger.warning("held task %s could not be queued once released: %s", task_id, exc)
        app.backend.store_result(task_id, exc, states.FAILURE)
        finish(app, client, keys, ttl_s, task_id, ok=False)
        return
    settings = settings_of(app)     # queued now: at the tier lent to it, if one is
    inherit.boost_released(client, keys, settings, [p.name for p in settings.pools], task_id)


def finished_outcomes(app: Celery, client: redis.Redis, deps: Sequence[str]) -> dict[str, str]:
    """The dependencies whose result is stored already: id -> OK | FAILED (a running or
    queued one is absent)."""
    with client.pipeline(transaction=False) as pipe:    # one key each: one slot each on a cluster
        for d in deps:
            pipe.get(app.backend.get_key_for_task(d))
        raws = pipe.execute()
    out: dict[str, str] = {}
    for dep, raw in zip(deps, raws):
        outcome = stored_outcome(raw)
        if outcome:
            out[dep] = outcome
    return out


def stored_outcome(raw: bytes | None) -> str:
    """OK | FAILED from a task's stored result, '' while it has none or is not finished
    (a running task's result says STARTED)."""
    if raw is None:
        return ""
    try:
        status = json.loads(raw).get("status")
    except (ValueError, AttributeError):
        return ""
    if status not in states.READY_STATES:
        return ""
    return OK if status == states.SUCCESS else FAILED


def dependency_ids(value: Any) -> tuple[str, ...]:
    """depends_on as a tuple of distinct task ids, in order (ValueError saying what is wrong)."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError("depends_on must be a list of task ids")
    ids = tuple(dict.fromkeys(value))
    if not all(isinstance(i, str) and i for i in ids):
        raise ValueError("depends_on must be a list of non-empty task id strings")
    if len(ids) > MAX_DEPENDENCIES:
        raise ValueError(f"depends_on names {len(ids)} tasks; at most {MAX_DEPENDENCIES}")
    return ids
