"""Every Redis key respool writes, in one place (DESIGN.md §3).

Per-response keys hash-tag the response id, so the scripts that touch several of them stay valid
on Redis Cluster; per-owner quota keys hash-tag the owner.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

PREFIX = "respool"


def events_key(response_id: str) -> str:
    """The response's event stream: entry id `0-<seq+1>`, fields `t` (type) and `d` (event JSON)."""
    return f"{PREFIX}:{{{response_id}}}:events"


def lease_key(response_id: str) -> str:
    """`"<attempt>:<worker>"` with a PX ttl, renewed by the holder's heartbeat."""
    return f"{PREFIX}:{{{response_id}}}:lease"


def attempt_key(response_id: str) -> str:
    """A counter, INCR on every acquire: the fencing token."""
    return f"{PREFIX}:{{{response_id}}}:attempt"


def cancel_key(response_id: str) -> str:
    """Present while a cancel has been requested."""
    return f"{PREFIX}:{{{response_id}}}:cancel"


def observed_key(response_id: str) -> str:
    """Present once any relay has read the response's events (set with that first read, atomically):
    a new attempt may then no longer start its output over (DESIGN.md §4, "Orphans")."""
    return f"{PREFIX}:{{{response_id}}}:observed"


def queued_key(response_id: str) -> str:
    """The name of the queue that holds the response, from its enqueue until it has ended (or is
    given up, or removed while waiting). Whatever its queue, a sweep can tell a response some queue
    holds from one Redis lost: deployments on one Postgres may each have a queue of their own."""
    return f"{PREFIX}:{{{response_id}}}:queued"


def response_keys(response_id: str) -> list[str]:
    """All of a response's own keys (for delete)."""
    return [
        queued_key(response_id),
        events_key(response_id),
        lease_key(response_id),
        attempt_key(response_id),
        cancel_key(response_id),
        observed_key(response_id),
        secrets_key(response_id),
        ticket_key(response_id),
        announce_key(response_id),
        journal_key(response_id),
    ]


def journal_key(response_id: str) -> str:
    """The tool loop's journal of what its event stream does not carry (a hash, DESIGN.md §10): per
    web search item id, what the model was told it found and the pages (to cite); under `usage`,
    the usage of the turns run so far. A takeover reads it, so it neither searches again nor loses
    the finished turns' usage. Lives as long as the event stream."""
    return f"{PREFIX}:{{{response_id}}}:journal"


def secrets_key(response_id: str) -> str:
    """The secrets a response's `mcp` tools carry (`headers`, `authorization`), JSON per server
    label: kept out of its row and events, read by the worker that runs it (DESIGN.md §10)."""
    return f"{PREFIX}:{{{response_id}}}:secrets"


def ticket_key(response_id: str) -> str:
    """The response's row as the API recorded it (`store.ticket`), from its enqueue until a worker
    takes it (GETDEL) or a few seconds pass: that worker calls the upstream while Postgres moves the
    row to `in_progress`, and appends nothing before it has (DESIGN.md §2, step 2)."""
    return f"{PREFIX}:{{{response_id}}}:ticket"


def announce_key(response_id: str) -> str:
    """A background response's `response.in_progress` event as its create encoded it (sequence 2),
    kept beside its ticket for as long: the take that starts the response appends it, in the same
    script that takes its lease (`queue.ResponseQueue.take_started`), where its worker's first
    append would have (a round trip of the worker's and a wake-up of Redis's a response)."""
    return f"{PREFIX}:{{{response_id}}}:announce"


def rate_key(owner: str) -> str:
    """The owner's request rate (GCRA): its theoretical arrival time in ms, PX ttl until it is past."""
    return f"{PREFIX}:quota:{{{owner}}}:rate"


def streams_key(owner: str) -> str:
    """The owner's open event streams: a sorted set of stream tokens scored by lease expiry (ms)."""
    return f"{PREFIX}:quota:{{{owner}}}:streams"


def webhook_slots_key(queue: str, endpoint: str) -> str:
    """The attempts to a webhook endpoint under way across every worker of `queue`: a sorted set of
    tokens scored by lease expiry (ms; worker/slots.py)."""
    return f"{PREFIX}:webhooks:{queue}:{{{endpoint}}}:slots"


def queue_key(queue: str) -> str:
    """The response queue (DESIGN.md §4): a list of response ids, taken from the left, enqueued on the
    right; one put back (a drained or abandoned response) goes to the left. The queue's keys hash-tag
    its name, so its scripts stay valid on Redis Cluster."""
    return f"{PREFIX}:queue:{{{queue}}}"


def held_key(queue: str) -> str:
    """Every response the queue holds (waiting, being taken or running), a sorted set: a waiting
    one scored +inf, a running one by when its holder's lease is due to be renewed by (ms); one
    past that with no lease is abandoned (its worker died) and is put back or given up."""
    return f"{PREFIX}:queue:{{{queue}}}:held"


def workers_key(queue: str) -> str:
    """The workers taking from the queue, a sorted set scored by when each is due to beat again (ms):
    one past it is dead, and what it was taking goes back to the queue."""
    return f"{PREFIX}:queue:{{{queue}}}:workers"


def taking_key(queue: str, worker: str) -> str:
    """What a worker has popped and not yet leased (a list; it holds an id for one round trip)."""
    return f"{PREFIX}:queue:{{{queue}}}:taking:{worker}"


def registries_lock_key(queue: str) -> str:
    """Held (PX) by the one worker handling RQ's abandoned delivery jobs of `queue` now (worker/runner/worker.py)."""
    return f"{PREFIX}:registries:{queue}"


def due_lock_key(queue: str, endpoints: Sequence[str]) -> str:
    """Held (PX) by the one worker queueing the due webhook deliveries of `queue` to `endpoints` now
    (worker/runner/deliveries.py, `queue_due`): workers that configure the same endpoints share it."""
    digest = hashlib.sha1("\n".join(sorted(endpoints)).encode()).hexdigest()[:16]
    return f"{PREFIX}:deliveries-due:{queue}:{digest}"


def sweep_lock_key(queue: str) -> str:
    """Held (PX) by the one worker sweeping `queue`'s orphans now (worker/runner/recovery.py)."""
    return f"{PREFIX}:sweep:{queue}"


def sweep_cursor_key(queue: str) -> str:
    """Where the last sweep of `queue`'s queued rows stopped: `[created_at, response_id]` as JSON."""
    return f"{PREFIX}:sweep:{queue}:queued"


def wake_key(process_id: str) -> str:
    """An API process's private wake-up stream, read in the same XREAD as the streams it relays."""
    return f"{PREFIX}:tailer:{process_id}"
