"""What respool's response queue holds, read from Redis (worker/queue.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from redis import Redis

from worker.keys import held_key, queue_key, taking_key, workers_key


@dataclass
class QueueView:
    """One queue of responses (`RESPOOL_QUEUE`), read on a synchronous client."""

    redis: Redis
    name: str

    def waiting(self) -> list[str]:
        """The ids in the queue, in the order workers will take them."""
        return [raw.decode() for raw in self.redis.lrange(queue_key(self.name), 0, -1)]

    def held(self) -> dict[str, float]:
        """Every response the queue holds, with its deadline (ms; +inf while it waits)."""
        return {
            raw.decode(): score
            for raw, score in self.redis.zrange(held_key(self.name), 0, -1, withscores=True)
        }

    def running(self) -> set[str]:
        """The responses held with a deadline: taken by a worker."""
        return {response_id for response_id, score in self.held().items() if not math.isinf(score)}

    def taking(self, worker: str) -> list[str]:
        return [raw.decode() for raw in self.redis.lrange(taking_key(self.name, worker), 0, -1)]

    def workers(self) -> set[str]:
        return {raw.decode() for raw in self.redis.zrange(workers_key(self.name), 0, -1)}
