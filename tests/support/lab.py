"""The fault tests' lab (tests/worker/runner): a module's own API, the workers each test starts
and kills, and what the tests ask of them."""

from __future__ import annotations

from dataclasses import dataclass, field

import openai
from redis import Redis

from tests.support.faults import lease_holders, worker_name
from tests.support.stack import Stack, wait_for
from tests.support.upstream_process import ScriptedUpstream
from worker.keys import events_key


@dataclass
class Lab:
    """What a fault test drives: the module's stack, the SDK, the upstream, Redis, its own workers."""

    stack: Stack
    sdk: openai.OpenAI
    upstream: ScriptedUpstream
    redis: Redis
    model: str
    workers: list[str] = field(default_factory=list)

    def start(self, name: str, env: dict[str, str] | None = None) -> str:
        """Start a worker and wait until it takes jobs (and a SIGTERM would drain it); its RQ name."""
        self.stack.start_worker(name, env=env)
        self.workers.append(name)
        return worker_name(self.redis, self.stack, name)

    def create(
        self, model: str, count: int, sdk: openai.OpenAI | None = None, *, seen: bool = False
    ) -> list[str]:
        """`count` background responses; `seen` ones are streamed to a client from their start (which
        stops reading at once), the rest are only polled: nobody sees their output until they end."""
        client = sdk or self.sdk
        if not seen:
            return [client.responses.create(model=model, input="x", background=True).id for _ in range(count)]
        created = []
        for _ in range(count):
            with client.responses.create(model=model, input="x", background=True, stream=True) as stream:
                created.append(next(iter(stream)).response.id)
        return created

    def held_by(self, response_ids: list[str], holder: str) -> None:
        """Wait until `holder` holds every one of the responses."""
        wait_for(
            lambda: set(lease_holders(self.redis, response_ids).values()) == {holder},
            timeout=60,
            what=f"{len(response_ids)} leases",
        )

    def streamed(self, response_ids: list[str]) -> None:
        """Wait until every one of the responses has streamed output to clients."""
        wait_for(lambda: all(has_output(self.redis, rid) for rid in response_ids), timeout=30, what="output")


def has_output(redis: Redis, response_id: str) -> bool:
    """Whether the response's stream holds output (a delta) yet."""
    return any(fields[b"t"].endswith(b".delta") for _, fields in redis.xrange(events_key(response_id)))
