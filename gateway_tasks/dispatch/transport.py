"""The workers' kombu transport: the producer's (``gateway_tasks.dispatch.broker``)
plus a consumer that dispatches through lua/dispatch/pick.lua.

Consumers do not BRPOP: a channel whose active queues are all gateway queues
(gt.<tier>.<pool>) alternates between

  PICK  EVALSHA pick.lua: choose by policy, admit through the pool bucket, RPOP,
        record in kombu's unacked hash/index -- one atomic call; and
  WAIT  BLPOP on its tiers' bells (enqueues, requeues, unparked tenants) and its
        pools' (token refunds)
        for as long as pick.lua said the buckets need, or until work arrives.

Both are single non-blocking-to-the-worker socket commands, so they plug into
kombu's event loop exactly where BRPOP did: the poll_start / poll_read hooks of
``gateway_tasks.dispatch.kombu_adapter``, the one module that touches kombu's private
API.  Channels that also consume other queues fall back to plain BRPOP.

The poll connection is the broker's (kombu's) unless the deployment's Redis is another
(a control Redis carries the broker: ``gateway_tasks.dispatch.broker``): then it is a
connection of the deployment's Redis -- on a Redis Cluster, to the master owning the
pool's slot, where every key of a pick and a bell wait lives (a dispatcher serves one
pool there: pick.lua takes its pools in one call).  A reply MOVED/ASK/CLUSTERDOWN/
TRYAGAIN (a failover, slots moved) or a lost connection refreshes the slot map
(``core.redis_client.after_redirect``); the next poll goes to the slot's owner now,
on a new connection, loading the scripts there if it lacks them (NOSCRIPT).
"""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from typing import Any

import redis
from kombu.utils.encoding import bytes_to_str
from redis.backoff import NoBackoff
from redis.retry import Retry

from gateway_tasks.dispatch import broker, kombu_adapter
from gateway_tasks.dispatch.kombu_adapter import Empty
from gateway_tasks.core.redis_failures import is_out_of_memory
from gateway_tasks.core.stats import DISPATCH_PICKS, DISPATCH_WAITS, STALE_RELEASES
from gateway_tasks.dispatch.dead_letters import DeadLetterer, problem_of
from gateway_tasks.dispatch.stats import DispatchTally
from gateway_tasks.core.faults import AFTER_ACK, AFTER_PICK, kill_point
from gateway_tasks.dispatch.leases import LeaseKeeper, sweep_expired
from gateway_tasks.dispatch.poll_step import (PICK, RESERVED_AND_OWN, RESERVED_AND_POOL, WAIT, next_step,
                                              wait_bells)
from gateway_tasks.core.redis_client import REDIRECTS, after_redirect, node_address, server_client
from gateway_tasks.core.redis_retry import through_restarts
from gateway_tasks.core.scripts import Scripts, scripts_for
from gateway_tasks.dispatch.release import ACK, REQUEUE, ReleaseCall
from gateway_tasks.dispatch.router import PickBatch, Picked, PickPlan, general_picks, kept_slots, pick_now

logger = logging.getLogger(__name__)

BRPOP = "brpop"   # the channel's mode when it consumes other queues too: kombu's own BRPOP
# the channel's mode while the deployment's Redis Cluster refuses its poll (CLUSTERDOWN: a master
# rejoining, or down; TRYAGAIN): a timed BLPOP on the broker's Redis, where nothing rings the key
PAUSE = "pause"
REFUSED_PAUSE_S = 0.25
MAX_WAIT_S = 1.0  # longest BLPOP on the bell; bounds how stale a decision can get
FULL_PAUSE_S = 0.5   # between picks refused by Redis at its maxmemory
FULL_WARN_EVERY = 20  # of those refusals in a row, one in this many is logged (every 10 s)
# the poll connection's commands are not retried in place: the event loop must not stall on
# a node that went away (the error ends the poll; the next one reconnects, to the owner now)
NO_RETRY = Retry(NoBackoff(), 0)


def bell_timeout(wait_s: float) -> str:
    """BLPOP's timeout argument for a wait of wait_s seconds (at least 1 ms).

    Whole milliseconds plus half a millisecond: Redis before 7.0 turns the
    seconds into milliseconds by truncating seconds * 1000, so "0.001" became
    0.999... -> 0, which BLPOP reads as *block forever* -- a dispatcher waiting
    for 1 ms of bucket refill then hung until the next bell ring.
    """
    ms = max(1, math.ceil(wait_s * 1000.0 - 1e-9))
    return f"{(ms + 0.5) / 1000.0:.4f}"


class QoS(kombu_adapter.QoS):
    """kombu's ack emulation for gateway queues: pick.lua already recorded the task as
    dispatched; ack, reject and every restore run lua/dispatch/release.lua (exactly once).
    Messages of other queues keep kombu's own bookkeeping."""

    def _gt_release(self, delivery_tag: Any, mode: str) -> bool:
        tag = bytes_to_str(delivery_tag)
        held = self.channel._gt_picked.get(tag)
        if held is None:
            return False
        pool, token = held
        channel = self.channel
        # while its last pick could take only reserved work, the release also rings this
        # dispatcher's own bell (same call): it picks other work again now, not after its wait
        wake = channel._gt_keys.dispatcher_bell(pool, channel._gt_id) if channel._gt_slot_limited else ""
        call = ReleaseCall(channel._gt_keys, channel._gt_settings, pool, tag, mode, token, wake=wake)
        try:
            done = self._gt_run_release(call)
        finally:
            self.channel._gt_picked.pop(tag, None)
            self.channel._gt_released_one()
        if done.stale:
            logger.warning("task %s finished after its lease expired and it was dispatched again: "
                           "a duplicate execution (counted in %s)", tag, STALE_RELEASES)
        return True

    def _gt_run_release(self, call: ReleaseCall) -> Any:
        """release.lua, retried while Redis is unreachable (a restart): the task stays held
        meanwhile, so its lease is renewed and nobody runs it again.  Past the retry budget
        the error propagates and the lease expires (a survivor restores the task)."""
        return through_restarts(lambda: self.channel._gt_scripts.run(call), f"release of task {call.tag}")

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag in self.channel._gt_picked:
            self.record_delivery(message, delivery_tag)  # Redis side done by pick.lua
        else:
            super().append(message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        if self._gt_release(delivery_tag, ACK):
            self.forget_delivery(delivery_tag)
            kill_point(AFTER_ACK)
        else:
            super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        # requeue: back to the front of its tenant's line, keeping its enqueue time
        if self._gt_release(delivery_tag, REQUEUE if requeue else ACK):
            self.forget_delivery(delivery_tag)
        else:
            super().reject(delivery_tag, requeue=requeue)

    def restore_by_tag(self, tag: Any, client: Any = None, leftmost: bool = False) -> None:
        if not self._gt_release(tag, REQUEUE):
            super().restore_by_tag(tag, client, leftmost)

    def restore_unacked(self, client: Any = None) -> None:
        """At channel close (worker shutdown, or the broker connection lost): gateway tasks
        still held here are left alone -- a task still running in a pool thread acks through
        this QoS when it ends (its lease is renewed until then), and if this process dies
        their leases expire and a survivor restores them.  Restoring them now would run
        them twice.  Other messages: kombu's restore (which cannot run once the connection
        is gone -- then the visibility timeout restores them)."""
        picked = self.channel._gt_picked
        for tag in self.delivered_tags():
            if bytes_to_str(tag) in picked:
                self.drop_delivered(tag)
        others = self.delivered_tags()
        if not others:
            return
        try:
            super().restore_unacked(client)
        except (AttributeError, redis.RedisError, OSError) as exc:
            logger.warning("could not restore %d unacked non-gateway message(s) at close (%s); "
                           "the visibility timeout will", len(others), exc)

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        """kombu's visibility-timeout restore, plus a sweep of expired gateway leases
        (the lease keeper sweeps too; this is the event loop's fallback)."""
        super().restore_visible(start, num, interval)
        if not self.restore_scanned(interval):
            return
        channel = self.channel
        sweep_expired(channel._gt_raw, channel._gt_scripts, channel._gt_keys, channel._gt_settings, num)


class Channel(broker.Channel):
    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # delivery tag -> (pool, dispatch token) of each task this channel holds
        self._gt_picked: dict[str, tuple[str, str]] = {}
        self._gt_closing = False
        self._gt_leases = LeaseKeeper(self._gt_raw, self._gt_scripts, self._gt_keys, self._gt_settings,
                                      lambda: self._gt_picked)
        self._gt_plan: PickPlan | None = None
        self._gt_batch: PickBatch | None = None   # the pick in flight
        self._gt_plan_for: tuple[str, ...] = ()
        self._gt_mode = PICK
        self._gt_wait_s = 0.0
        self._gt_wait_ms = -1   # pick.lua's wait behind the next WAIT (-1: none known)
        self._gt_tally = DispatchTally(self._gt_keys)
        self._gt_refused = 0     # picks refused in a row by Redis at its maxmemory
        # slots kept for reserved tiers' interactive work (Settings.reserved_worker_slots):
        # while only those are free, the wait also listens on this dispatcher's own bell
        self._gt_id = uuid.uuid4().hex[:12]
        self._gt_slot_limited = False
        # poll clients of the deployment's Redis by node address (a control Redis is the broker)
        self._gt_polls: dict[tuple[str, int] | None, redis.Redis] = {}

    def _gt_count(self, name: str) -> None:
        self._gt_tally.round_trip(name)
        if self._gt_tally.due():
            self._gt_tally.flush(self._gt_raw)

    def close(self) -> None:
        # tasks still running keep their leases until they are released (the broker
        # connection was lost, the process lives on): the keeper stops with the last one
        self._gt_closing = True
        self._gt_released_one()
        with contextlib.suppress(redis.RedisError, OSError):
            self._gt_tally.flush(self._gt_raw)
        super().close()
        self._gt_drop_polls()

    # -- the poll connection ----------------------------------------------------
    def poll_client(self) -> redis.Redis:
        """kombu's client, unless the deployment's Redis is not the broker's and this channel
        dispatches (its queues are all gateway queues): then a client of the deployment's
        Redis, on a cluster of the master that owns the pool's slot as the slot map says now."""
        if not getattr(self, "_gt_data_url", ""):   # kombu pings before this channel is set up
            return self.kombu_client()
        if self._in_poll:   # a reply is awaited: on the connection it was sent on
            for found in self._gt_polls.values():
                if found.connection is self._in_poll:
                    return found
            return self.kombu_client()
        plan = self._gt_plan_now()
        if plan is None or self._gt_mode == PAUSE:
            return self.kombu_client()
        address = node_address(self._gt_raw, self._gt_keys.pool_tag(plan.pools[0].name))
        found = self._gt_polls.get(address)
        if found is None:
            self._gt_drop_polls()   # one of another node: the slot has moved
            found = self._gt_polls[address] = server_client(self._gt_data_url, address,
                                                            wrap=self.poll_connection_class, retry=NO_RETRY)
        return found

    def _gt_poll_scripts(self) -> Scripts:
        """The scripts of the poll connection's server: the raw client's, or on a poll client
        of its own, that client's (loaded on its node, over the poll connection while idle)."""
        return scripts_for(self.client) if self._gt_data_url else self._gt_scripts

    def _gt_drop_polls(self) -> None:
        """Close the poll clients of the deployment's Redis (kombu's poller stops watching
        their sockets as they disconnect)."""
        polls, self._gt_polls = self._gt_polls, {}
        for client in polls.values():
            conn, client.connection = client.connection, None
            with contextlib.suppress(redis.RedisError, OSError):
                if conn is not None:
                    conn.disconnect()
                client.connection_pool.disconnect()

    def _gt_redirected(self, exc: BaseException) -> None:
        """The poll's node said the slot is elsewhere, or refused it (CLUSTERDOWN, TRYAGAIN):
        refresh the slot map; the next poll reconnects to the owner now -- after a pause of
        REFUSED_PAUSE_S when refused (the cluster is rejoining: asking again at once would
        spin)."""
        refused = not isinstance(exc, redis.exceptions.AskError)   # MovedError is an AskError
        if self._gt_refused % FULL_WARN_EVERY == 0 or not refused:
            logger.warning("dispatcher %s: the Redis Cluster answered %s to a poll; refreshing its slot map%s",
                           self._gt_id, type(exc).__name__, " and pausing" if refused else "")
        self._gt_refused = self._gt_refused + 1 if refused else 0
        after_redirect(self._gt_raw, exc)
        self._gt_drop_polls()
        if refused:
            self._gt_mode = PAUSE

    def _gt_released_one(self) -> None:
        if self._gt_closing and not self._gt_picked:
            self._gt_leases.stop()

    def _gt_own_bells(self, plan: PickPlan) -> list[str]:
        """This dispatcher's own bell in each pool (rung by release.lua when one of its tasks
        ends while it could take only reserved work)."""
        return [self._gt_keys.dispatcher_bell(pool.name, self._gt_id) for pool in plan.pools]

    def _gt_runnable(self, picked: Picked) -> bool:
        """False when the picked message cannot be run: it is dead-lettered instead."""
        problem = problem_of(picked, self._gt_settings)
        if problem is None:
            return True
        DeadLetterer(self._gt_raw, self._gt_scripts, self._gt_keys, self._gt_settings,
                     _mark_failed)(picked, problem)
        return False

    def _gt_hold(self, picked: Picked) -> None:
        self._gt_picked[picked.tag] = (picked.pool, str(picked.dispatched_ms))

    # -- consuming ------------------------------------------------------------
    def _gt_plan_now(self) -> PickPlan | None:
        queues = tuple(self.active_queues)
        if not queues or not all(broker.is_gateway_queue(q) for q in queues):
            return None
        if queues != self._gt_plan_for:
            self._gt_plan = PickPlan(self._gt_settings, sorted(queues))
            self._gt_plan_for = queues
            self._gt_leases.start()   # a consuming dispatcher renews its leases and sweeps others'
        return self._gt_plan

    def poll_start(self, timeout: float | None = None) -> None:
        plan = self._gt_plan_now()
        if plan is None:
            self._gt_mode = BRPOP
            return super().poll_start(timeout)
        conn = self.poll_begin()
        if self._gt_mode == PAUSE:   # on the broker's Redis (poll_client): a timer, not a poll
            conn.send_command("BLPOP", self._gt_own_bells(plan)[0], bell_timeout(REFUSED_PAUSE_S))
            return
        # its free slots now, of them how many may take work outside the reserve; a slot of its
        # own freed since it began waiting for one: pick (gateway_tasks.dispatch.poll_step)
        free = self.qos.can_consume_max_estimate() or 1
        general = self._gt_general_now(plan, free)
        self._gt_mode = next_step(self._gt_mode, self._gt_slot_limited, general)
        if self._gt_mode == WAIT:
            self._gt_count(DISPATCH_WAITS)
            # with only kept slots free: woken by reserved interactive work or a slot of its own
            # freeing -- never taking the wake-up of other work it could not pick
            # waiting for the bucket: woken by reserved interactive work or refunds that end the
            # wait, not by each arrival that could not be dispatched sooner (poll_step.wait_bells)
            which = wait_bells(self._gt_slot_limited, self._gt_wait_ms, len(plan.pools))
            bells = (plan.bell_keys if which not in (RESERVED_AND_OWN, RESERVED_AND_POOL)
                     else [*plan.reserved_bell_keys, *(self._gt_own_bells(plan) if which == RESERVED_AND_OWN
                                                       else plan.pool_bell_keys)])
            conn.send_command("BLPOP", *bells, bell_timeout(self._gt_wait_s))
        else:
            self._gt_mode = PICK
            self._gt_count(DISPATCH_PICKS)
            # as many tasks as this channel has free slots for, in one call, keeping some
            # of them for reserved tiers' interactive work
            self._gt_batch = plan.batch(free, general)
            self._gt_slot_limited = self._gt_batch.general == 0
            conn.send_command(*self._gt_poll_scripts().command(self._gt_batch))

    def _gt_general_now(self, plan: PickPlan, free: int | None = None) -> int:
        """pick.lua's ARGV[7] for this dispatcher's free slots now (``free``: as counted
        already): how many may take work outside the reserve (NO_LIMIT: any)."""
        if free is None:
            free = self.qos.can_consume_max_estimate() or 1
        kept = kept_slots(self._gt_settings.reserved_worker_slots, self.qos.prefetch_count,
                          plan.serves_reserved)
        return general_picks(free, kept)

    def poll_read(self, **options: Any) -> bool:
        if self._gt_mode == BRPOP:
            return super().poll_read(**options)
        mode = self._gt_mode
        if mode == PAUSE:
            with self.poll_read_done():
                self._gt_mode = PICK
                try:
                    self.read_poll_reply("BLPOP", **options)
                finally:   # kombu's poller stops watching the broker connection: polls go elsewhere
                    paused_on = self.kombu_client().connection
                    if paused_on is not None:
                        paused_on.disconnect()
                raise Empty()
        with self.poll_read_done():
            try:
                reply = self.read_poll_reply("EVALSHA" if mode == PICK else "BLPOP", **options)
            except redis.exceptions.NoScriptError:
                self._gt_poll_scripts().lost()  # the server lost its scripts (restart): load on the next poll
                raise Empty() from None
            except REDIRECTS as exc:
                self._gt_redirected(exc)   # nothing ran: poll the slot's owner now (after a pause if refused)
                raise Empty() from None
            except redis.ConnectionError as exc:
                if self._gt_polls:   # the deployment's Redis is not the broker's: find its owner again
                    after_redirect(self._gt_raw, exc)
                raise
            except redis.exceptions.ResponseError as exc:
                if mode != PICK or not is_out_of_memory(exc):
                    raise
                self._gt_full(exc)   # Redis at its maxmemory refused the pick: wait, pick again
                raise Empty() from None
            if mode == WAIT:
                self._gt_mode = PICK
                raise Empty()
            self._gt_refused = 0
            plan = self._gt_plan
            result = self._gt_batch.parse(reply)
            if isinstance(result, list):
                delivered = 0
                for picked in result:
                    if picked.payload is None:   # too large to come back inline: fetch it
                        picked = plan.with_payload(self._gt_raw, picked)  # type: ignore[union-attr]
                    if not self._gt_runnable(picked):
                        continue                 # dead-lettered
                    self._gt_hold(picked)
                    kill_point(AFTER_PICK)
                    self._gt_tally.dispatched(picked)
                    self.deliver_message(picked.payload, picked.queue)
                    delivered += 1
                if not delivered:
                    raise Empty()                # all dead-lettered: pick again at once
                # the call took fewer than it was asked for: its other slots wait (a pick now
                # would find what the call just found missing) -- unless only kept slots are
                # left: then the next pick, sent with its slot-limited mark set (releases ring its
                # own bell from then on), looks for reserved work and leads to that wait.  Waiting
                # here instead would miss a release that ran before the mark and whose freed
                # slot this thread's count does not show yet (an ack's bookkeeping follows it)
                rest_ms = self._gt_batch.rest_wait_ms(reply)
                if (len(result) < self._gt_batch.max_picks and rest_ms != 0
                        and self._gt_general_now(plan) != 0):
                    self._gt_wait(rest_ms)
                return True
            self._gt_wait(result.wait_ms)
            raise Empty()

    def _gt_wait(self, wait_ms: int) -> None:
        """Wait on the bells next, for ``wait_ms`` (-1: MAX_WAIT_S, until a bell rings)."""
        self._gt_wait_s = MAX_WAIT_S if wait_ms < 0 else min(MAX_WAIT_S, max(0.001, wait_ms / 1000.0))
        self._gt_wait_ms = wait_ms
        self._gt_mode = WAIT

    def _gt_full(self, exc: BaseException) -> None:
        """A pick refused at maxmemory (noeviction: pick.lua's first write is refused, nothing
        was taken): wait ``FULL_PAUSE_S`` on the bell and pick again.  Tasks in flight still
        finish (their acks free memory); the worker lives on."""
        if self._gt_refused % FULL_WARN_EVERY == 0:
            logger.warning("pick refused: Redis is at its maxmemory (%s); picking again every "
                           "%.1f s until memory frees (%d refused so far)", exc, FULL_PAUSE_S,
                           self._gt_refused + 1)
        self._gt_refused += 1
        self._gt_mode = WAIT
        self._gt_wait_ms = -1
        self._gt_wait_s = FULL_PAUSE_S

    def get_message(self, queue: str) -> Any:
        """basic_get: one pick restricted to this queue (used by tools, not the worker loop)."""
        if not broker.is_gateway_queue(queue):
            return super().get_message(queue)
        result = pick_now(self._gt_scripts, PickPlan(self._gt_settings, [queue]))
        if not isinstance(result, Picked) or not self._gt_runnable(result):
            raise Empty()
        self._gt_hold(result)
        self._gt_tally.dispatched(result)
        return result.payload


def _mark_failed(task_id: str, exc: BaseException) -> None:
    """Store a task's failure with the worker's Celery app (its result backend)."""
    from celery import current_app
    current_app.backend.mark_as_failure(task_id, exc)


class Transport(broker.Transport):
    Channel = Channel
    driver_name = "gateway-redis"
