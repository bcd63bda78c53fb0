"""The scenarios of `respool bench` (api/bench/run.py), each against every system in turn, so all see
the same machine at the same moment:
1. memory: `memory_streams` streams in flight at once; the growth of each process's RSS over its
   idle size, per stream (respool's API and workers, LiteLLM's process);
2. latency at 1 and at 50 concurrent streams: TTFT and gaps between tokens, and what each proxy
   adds to the direct upstream;
3. held streams: levels of concurrent streams (64 tokens, 20 ms apart) until a system loses or
   stalls a stream or adds 25 ms or more to the gap p99;
4. short non-streaming responses per second: foreground, and (respool) background: create + poll,
   and create + wait for the webhook that tells the response ended (api/bench/told.py);
5. what each proxy costs in CPU (api/bench/cpu.py; issue 20): its whole process tree's CPU time per
   relayed token at 30 and 100 streams (150 tokens 20 ms apart; at least 90 streams a level, in
   waves of as many as run at once), per short foreground request and per background response (its
   polls' cost taken out, and one poll's cost beside it) and per short foreground request at the
   background responses' rate (each client waiting as long as a background one waits for its
   poll), its idle cost subtracted; and the load generator's own CPU per token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil
from rich.progress import Progress

from api.bench import cpu, load, stats
from api.bench.load import Target
from api.bench.told import Receiver

HOLD_TOKENS, HOLD_PACE_MS = 64, 20
MAX_ADDED_GAP_P99_MS = 25.0


@dataclass(frozen=True)
class Plan:
    """How much load each scenario sends (bounded in count and time)."""

    latency_tokens: int = 32
    latency_pace_ms: int = 10
    single_streams: int = 40  # one at a time
    concurrent: int = 50
    concurrent_streams: int = 150  # 50 at a time, each client starting its next at once
    levels: tuple[int, ...] = (25, 50, 100, 150, 200, 300, 400)
    hold_ramp_seconds: float = 0.5
    short_seconds: float = 5.0
    short_concurrency: int = 64  # foreground clients
    background_concurrency: int = 256  # background clients, each polling every `poll_seconds`
    short_tokens: int = 8
    poll_seconds: float = 0.25
    memory_streams: int = 200
    memory_tokens: int = 50
    memory_pace_ms: int = 100
    worker_counts: tuple[int, ...] = (1, 2)
    cost_streams: tuple[int, ...] = (30, 100)  # concurrent streams
    # At least this many streams a level, in waves of as many as run at once: 30 streams' 4,500
    # tokens cost respool under a second of CPU, and one run read 141 then 181 µs a token ten
    # minutes apart on one build (README, CPU cost); three waves at 30 streams, one at 100.
    cost_min_streams: int = 90
    cost_tokens: int = 150
    cost_pace_ms: int = 20
    cost_requests: int = 400  # short requests, `cost_concurrency` at a time
    cost_polls: int = 400  # polls of an ended response, for a poll's own cost
    cost_concurrency: int = 16
    idle_seconds: float = 10.0  # how long each tree is watched idle (its periodic work comes every 2 s)

    @classmethod
    def quick(cls) -> Plan:
        """A run of a few seconds a scenario, to see that everything works (not for figures)."""
        return cls(
            single_streams=5,
            concurrent=5,
            concurrent_streams=10,
            levels=(5, 10),
            short_seconds=1.0,
            short_concurrency=8,
            background_concurrency=16,
            memory_streams=10,
            memory_tokens=30,
            memory_pace_ms=50,
            cost_streams=(5, 10),
            cost_min_streams=12,  # three waves of 5, two of 10
            cost_tokens=20,
            cost_requests=20,
            cost_polls=200,  # a poll costs under half a ms: 20 fit in one of /proc's 10 ms ticks
            cost_concurrency=4,
            idle_seconds=0.5,
        )


@dataclass
class System:
    """One target and the processes whose memory it is measured by."""

    target: Target
    processes: dict[str, list[psutil.Process]]
    result: dict[str, Any] = field(default_factory=dict)
    receiver: Receiver | None = None  # respool's webhooks reach it (the "webhooks" scenario)
    tree: cpu.Tree | None = None  # the processes whose CPU it costs (a proxy's; not the upstream's)


async def run_all(plan: Plan, progress: Progress, systems: list[System], direct: System) -> None:
    await _warm_up(plan, systems)
    for system in systems:
        if system.processes:
            system.result["memory"] = await _memory(plan, progress, system)
    for concurrency, count in ((1, plan.single_streams), (plan.concurrent, plan.concurrent_streams)):
        for system in systems:
            summary = await _streams(
                plan, progress, system, concurrency, count, plan.latency_tokens, plan.latency_pace_ms
            )
            system.result.setdefault("latency", {})[str(concurrency)] = summary
    for system in systems:
        if system is not direct:
            system.result["added"] = {
                level: stats.added(summary, direct.result["latency"][level])
                for level, summary in system.result["latency"].items()
            }
    await _levels(plan, progress, systems, direct)
    for system in systems:
        system.result["short"] = await _short(plan, progress, system)
    for system in systems:
        if system.tree is not None:
            system.result["cpu"] = await _cost(plan, progress, system)


async def _warm_up(plan: Plan, systems: list[System]) -> None:
    """A few streams and short requests through each system first: connections, caches, imports."""
    for system in systems:
        await load.streams(system.target, concurrency=4, count=8, tokens=4, pace_ms=1)
        model = load.model_name(plan.short_tokens, 0)
        await load.short_requests(system.target, background=False, concurrency=4, seconds=0.3, model=model)


async def _streams(
    plan: Plan,
    progress: Progress,
    system: System,
    concurrency: int,
    count: int,
    tokens: int,
    pace_ms: int,
    ramp_seconds: float = 0.0,
) -> dict[str, Any]:
    with _step(progress, f"{system.target.name}: {concurrency} concurrent streams", count) as advance:
        samples = await load.streams(
            system.target,
            concurrency=concurrency,
            count=count,
            tokens=tokens,
            pace_ms=pace_ms,
            ramp_seconds=ramp_seconds,
            on_done=advance,
        )
    return stats.summarize(samples, tokens)


async def _levels(plan: Plan, progress: Progress, systems: list[System], direct: System) -> None:
    """Raise the number of concurrent streams level by level while some system still holds them.

    The direct upstream runs each level first, as the baseline of every proxy at that level; in the
    run that measures it, it also goes on while it holds the level itself (its gap p99 within 25 ms
    of the pace): how far the upstream and the load generator alone get on this machine.
    A system's `max_streams_held` is the highest level of an unbroken run of held levels.
    """
    proxies = [system for system in systems if system is not direct]
    going = {system.target.name for system in proxies}
    direct_going = direct in systems
    for system in [direct, *proxies]:
        system.result.setdefault("levels", {})
        system.result.setdefault("max_streams_held", 0)
    for level in plan.levels:
        if not going and not direct_going:
            break
        key = str(level)
        active = [system for system in proxies if system.target.name in going]
        if key not in direct.result["levels"] and (active or direct_going):
            active.insert(0, direct)
        for system in active:
            summary = await _streams(
                plan, progress, system, level, level, HOLD_TOKENS, HOLD_PACE_MS, plan.hold_ramp_seconds
            )
            if system is direct:
                summary["added"] = stats.added(summary, summary)
                summary["held"] = stats.is_held(
                    summary, stats.over_pace(summary, HOLD_PACE_MS), MAX_ADDED_GAP_P99_MS
                )
            else:
                summary["added"] = stats.added(summary, direct.result["levels"][key])
                summary["held"] = stats.is_held(summary, summary["added"], MAX_ADDED_GAP_P99_MS)
            system.result["levels"][key] = summary
            if summary["held"] and system.result["max_streams_held"] == _previous(plan.levels, level):
                system.result["max_streams_held"] = level
            elif not summary["held"]:
                if system is direct:
                    direct_going = False
                going.discard(system.target.name)


def _previous(levels: tuple[int, ...], level: int) -> int:
    index = levels.index(level)
    return levels[index - 1] if index else 0


async def _short(plan: Plan, progress: Progress, system: System) -> dict[str, Any]:
    model = load.model_name(plan.short_tokens, 0)
    modes = ["foreground"]
    if system.target.name.startswith("respool"):
        modes.append("background")  # polling
    if system.receiver is not None:
        modes.append("webhooks")
    result: dict[str, Any] = {}
    for kind in modes:
        background = kind != "foreground"
        told = system.receiver if kind == "webhooks" else None
        with _step(progress, f"{system.target.name}: short {kind} requests", None) as advance:
            async with told.serving() if told is not None else contextlib.nullcontext():
                measured = await load.short_requests(
                    system.target,
                    background=background,
                    concurrency=plan.background_concurrency if background else plan.short_concurrency,
                    seconds=plan.short_seconds,
                    model=model,
                    poll_seconds=plan.poll_seconds,
                    told=told,
                    on_done=advance,
                )
        result[kind] = {
            "per_second": round(measured.per_second, 1),
            "completed": measured.completed,
            "errors": measured.errors,
            "first_error": measured.first_error,
            "latency_ms": {
                "p50": _ms(stats.percentile(measured.latencies, 50)),
                "p99": _ms(stats.percentile(measured.latencies, 99)),
            },
            "requests_per_response": round(measured.requests / measured.completed, 2)
            if measured.completed
            else None,
        }
        if told is not None:
            result[kind]["webhooks_refused"] = told.refused  # a signature that did not verify
    return result


async def _cost(plan: Plan, progress: Progress, system: System) -> dict[str, Any]:
    """CPU per token and per request of the system's tree, and the load generator's (module docstring)."""
    assert system.tree is not None
    trees = {"system": system.tree, "load": cpu.own()}
    target = system.target
    with _step(progress, f"{target.name}: CPU cost", None):
        idle = await asyncio.to_thread(cpu.idle_rates, trees, plan.idle_seconds)
        result: dict[str, Any] = {"idle_cores": round(idle["system"], 4), "streams": {}}
        for concurrency in plan.cost_streams:
            before = cpu.read(trees)
            waves = max(1, -(-plan.cost_min_streams // concurrency))
            samples = await load.streams(
                target,
                concurrency=concurrency,
                count=concurrency * waves,
                tokens=plan.cost_tokens,
                pace_ms=plan.cost_pace_ms,
            )
            used = cpu.spent(before, cpu.read(trees), idle)
            tokens = sum(sample.tokens for sample in samples)
            result["streams"][str(concurrency)] = {
                "tokens": tokens,
                "clean": sum(sample.is_clean(plan.cost_tokens) for sample in samples),
                "first_error": next((sample.error for sample in samples if sample.error), None),
                "us_per_token": cpu.per_unit(used["system"], tokens, 1e6),
                "load_us_per_token": cpu.per_unit(used["load"], tokens, 1e6),
            }
        model = load.model_name(plan.short_tokens, 0)
        # (kind, background, each foreground client's pause after each request)
        modes = [("foreground", False, 0.0)]
        if target.name.startswith("respool"):
            # A background response's clients wait for their polls: their responses come a few at a
            # time, where foreground clients keep the system busy. The same foreground requests at
            # that rate tell the rate's share of a background response's cost from its own.
            modes += [("background", True, 0.0), ("foreground_paced", False, plan.poll_seconds)]
        for kind, background, pause in modes:
            before = cpu.read(trees)
            done = await load.short_count(
                target,
                background=background,
                count=plan.cost_requests,
                concurrency=plan.cost_concurrency,
                model=model,
                poll_seconds=plan.poll_seconds,
                pause_seconds=pause,
            )
            used = cpu.spent(before, cpu.read(trees), idle)
            result[kind] = {
                "completed": done.completed,
                "errors": done.errors,
                "first_error": done.first_error,
                "polls": done.polls,
                "ms_cpu": round(used["system"] * 1000, 1),
            }
            if background and done.response_ids:
                before = cpu.read(trees)
                polled = await load.polls(
                    target, done.response_ids[0], count=plan.cost_polls, concurrency=plan.cost_concurrency
                )
                per_poll = cpu.spent(before, cpu.read(trees), idle)["system"] / max(1, polled.polls)
                result["ms_per_poll"] = round(per_poll * 1000, 3)
                without_polls = used["system"] - per_poll * done.polls
                result[kind]["ms_per_response"] = cpu.per_unit(max(0.0, without_polls), done.completed, 1e3)
            else:
                result[kind]["ms_per_response"] = cpu.per_unit(used["system"], done.completed, 1e3)
    return result


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


async def _memory(plan: Plan, progress: Progress, system: System) -> dict[str, Any]:
    """RSS growth per in-flight stream: each process's RSS with `memory_streams` streams in flight
    (sampled mid-stream) over its RSS just before, divided by the number of streams."""
    before = _rss(system.processes)
    streams = plan.memory_streams
    seconds = plan.memory_tokens * plan.memory_pace_ms / 1000
    ramp = min(1.0, seconds / 4)
    done = 0

    def finished() -> None:
        nonlocal done
        done += 1
        advance()

    with _step(progress, f"{system.target.name}: {streams} streams in flight (memory)", streams) as advance:
        running = asyncio.ensure_future(
            load.streams(
                system.target,
                concurrency=streams,
                count=streams,
                tokens=plan.memory_tokens,
                pace_ms=plan.memory_pace_ms,
                ramp_seconds=ramp,
                on_done=finished,
            )
        )
        await asyncio.sleep(ramp + (seconds - ramp) / 2)
        during = _rss(system.processes)
        in_flight = streams - done
        samples = await running
    summary = stats.summarize(samples, plan.memory_tokens)
    return {
        "streams": streams,
        "processes": {name: len(group) for name, group in system.processes.items()},
        "in_flight_when_measured": int(in_flight),
        "clean": summary["clean"],
        "kb_per_stream": {
            name: round((during[name] - before[name]) / 1024 / max(1, int(in_flight)), 1) for name in before
        },
        "rss_mb": {
            name: {"idle": round(before[name] / 2**20, 1), "loaded": round(during[name] / 2**20, 1)}
            for name in before
        },
    }


@contextmanager
def _step(progress: Progress, description: str, total: int | None) -> Iterator[Callable[[], None]]:
    """A progress bar for one step, gone once it is done (few bars, little rendering: the load
    generator shares the machine)."""
    task = progress.add_task(description, total=total)
    try:
        yield lambda: progress.advance(task)
    finally:
        progress.remove_task(task)


def _rss(processes: dict[str, list[psutil.Process]]) -> dict[str, int]:
    """Each group's resident memory in bytes (a group's processes summed)."""
    return {name: sum(process.memory_info().rss for process in group) for name, group in processes.items()}
