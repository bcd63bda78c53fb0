"""`respool bench` end to end (a `--quick` run, real processes), and its arithmetic.

The figures of a quick run mean nothing (the machine is busy with tests): what is checked is that
every scenario ran against every system, every stream was clean and every figure is there, with
the JSON, the table and the PNG written. Speed is never asserted (STYLE.md 17).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from api.bench import report, stats
from api.bench.litellm import find_litellm
from api.bench.load import StreamSample, is_end, tokens_in
from tests.support.stack import ROOT, Servers

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_percentiles_interpolate_between_ranks() -> None:
    assert stats.percentile([], 50) is None
    assert stats.percentile([3.0], 99) == 3.0
    assert stats.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert stats.percentile([float(i) for i in range(101)], 99) == 99.0


def test_added_is_the_difference_of_percentiles_and_held_needs_every_stream_clean() -> None:
    direct = stats.summarize([StreamSample(tokens=2, ttft=0.002, gaps=[0.020])], 2)
    proxy = stats.summarize([StreamSample(tokens=2, ttft=0.007, gaps=[0.021])], 2)
    added = stats.added(proxy, direct)
    assert added["ttft_ms"] == {"p50": 5.0, "p99": 5.0}
    assert added["gap_ms"]["p50"] == pytest.approx(1.0)
    assert stats.is_held(proxy, added, 25.0)
    lost = stats.summarize([StreamSample(tokens=1, ttft=0.007, gaps=[], error="1 tokens of 2")], 2)
    assert not stats.is_held(lost, stats.added(lost, direct), 25.0)
    slow = stats.summarize([StreamSample(tokens=2, ttft=0.007, gaps=[0.060], max_gap=0.06)], 2)
    assert not stats.is_held(slow, stats.added(slow, direct), 25.0)


def test_the_direct_upstream_holds_a_level_while_its_gaps_stay_near_its_pace() -> None:
    steady = stats.summarize([StreamSample(tokens=3, ttft=0.002, gaps=[0.020, 0.030])], 3)
    assert stats.over_pace(steady, 20)["gap_ms"]["p99"] == pytest.approx(9.9)
    assert stats.is_held(steady, stats.over_pace(steady, 20), 25.0)
    late = stats.summarize([StreamSample(tokens=3, ttft=0.002, gaps=[0.020, 0.050])], 3)
    assert not stats.is_held(late, stats.over_pace(late, 20), 25.0)


def test_cpu_costs_are_also_told_as_fractions_of_litellms() -> None:
    """The hour's speed moves both systems' costs: each CPU row LiteLLM has is also given as a
    fraction of LiteLLM's in the same run (background responses, which LiteLLM has not, are not)."""

    def system(per_token: float, per_short: float, per_background: float | None) -> dict[str, Any]:
        cpu: dict[str, Any] = {
            "streams": {"30": {"us_per_token": per_token}},
            "foreground": {"ms_per_response": per_short},
        }
        if per_background is not None:
            cpu["background"] = {"ms_per_response": per_background}
        return {"cpu": cpu}

    result = {
        "plan": {"concurrent": 50, "cost_streams": [30]},
        "systems": {"litellm": system(1000.0, 10.0, None), "respool": system(170.0, 4.0, 4.5)},
    }
    table = report.rows(result)
    assert table["CPU per token @30, over LiteLLM's"] == {"litellm": None, "respool": 0.17}
    assert table["CPU per short request, over LiteLLM's"] == {"litellm": None, "respool": 0.4}
    assert not any(row.startswith("CPU per background response") for row in table)


def test_the_cpu_plot_has_a_bar_per_system_and_figure_and_the_targets(tmp_path: Path) -> None:
    """`cpu.png` (issue 20: the CPU figures in the table, the JSON and the plot): per relayed token at
    each cost level, per response (short, background, short at the background rate, poll) and the load
    generator's per token; a figure a system lacks is no bar, a system with none (the direct upstream)
    is left out of the panel."""
    respool = {
        "cpu": {
            "streams": {
                "30": {"us_per_token": 166.8, "load_us_per_token": 29.7},
                "100": {"us_per_token": 122.7, "load_us_per_token": 22.2},
            },
            "foreground": {"ms_per_response": 3.3},
            "background": {"ms_per_response": 3.8},
            "foreground_paced": {"ms_per_response": 4.6},
            "ms_per_poll": 0.35,
        }
    }
    litellm = {
        "cpu": {
            "streams": {"30": {"us_per_token": 1583.5, "load_us_per_token": 67.9}},
            "foreground": {"ms_per_response": 21.8},
        }
    }
    result = {
        "plan": {"concurrent": 50, "cost_streams": [30, 100]},
        "machine": {"cpus": 2, "date": "2026-11-28 10:13:58 UTC"},
        "systems": {"direct": {"levels": {}}, "litellm": litellm, "respool (1 worker)": respool},
    }
    token, response, load_ = report.cost_panels(result)
    assert token.labels == ("30 streams", "100 streams") and token.target == 170
    assert token.bars == {"litellm": [1583.5, None], "respool (1 worker)": [166.8, 122.7]}
    assert response.target == 5 and len(response.labels) == 4
    assert response.bars == {"litellm": [21.8, None, None, None], "respool (1 worker)": [3.3, 3.8, 4.6, 0.35]}
    assert load_.target is None
    assert load_.bars == {"litellm": [67.9, None], "respool (1 worker)": [29.7, 22.2]}
    report.draw_cost(result, tmp_path / "cpu.png")
    assert (tmp_path / "cpu.png").read_bytes().startswith(PNG_MAGIC)


def test_tokens_are_counted_in_delta_frames_only() -> None:
    """A Responses stream repeats the text in its `.done` and `completed` events: only deltas count."""
    delta = (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"tok tok "}'
    )
    done = b'event: response.output_text.done\ndata: {"type":"response.output_text.done","text":"tok tok "}'
    completed = b'event: response.completed\ndata: {"type":"response.completed"}'
    assert (tokens_in(delta, False), tokens_in(done, False), tokens_in(completed, False)) == (2, 0, 0)
    assert is_end(completed, False)
    assert not is_end(done, False)
    assert tokens_in(b'data: {"choices":[{"delta":{"content":"tok "}}]}', True) == 1
    assert is_end(b"data: [DONE]", True)


@pytest.mark.integration
@pytest.mark.bench
@pytest.mark.timeout(420)  # its run may take 400 s (below); 120 s was too few on a slow hour
def test_a_quick_bench_measures_every_system(backing: Servers, tmp_path: Path) -> None:
    """One worker, then two; LiteLLM too where it is installed (CI installs it)."""
    out = tmp_path / "bench"
    env = {
        **os.environ,
        "RESPOOL_REDIS_URL": backing.redis_url,
        "RESPOOL_DATABASE_URL": backing.database_url,
        "COLUMNS": "160",
    }
    litellm = find_litellm(os.environ.get("RESPOOL_BENCH_LITELLM"))
    command = [sys.executable, "-m", "api", "bench", "--quick", "--out", str(out)]
    command += ["--litellm", str(litellm)] if litellm else ["--no-litellm"]
    finished = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "respool bench" in finished.stdout  # the table's title

    result = json.loads((out / "result.json").read_text())
    names = {"direct", "respool (1 worker)", "respool (2 workers)"} | ({"litellm"} if litellm else set())
    assert set(result["systems"]) == names
    for name, system in result["systems"].items():
        for level, summary in system["latency"].items():
            assert summary["clean"] == summary["streams"] > 0, (name, level, summary["first_error"])
            assert summary["ttft_ms"]["p50"] > 0
        assert system["levels"], name
        assert system["short"]["foreground"]["completed"] > 0, (name, system["short"])
        if name.startswith("respool"):
            assert system["short"]["background"]["completed"] > 0, system["short"]
            assert system["short"]["background"]["errors"] == 0, system["short"]
            told = system["short"]["webhooks"]  # each client waited for its webhook: no poll
            assert told["completed"] > 0 and told["errors"] == 0 and told["webhooks_refused"] == 0, told
            assert told["requests_per_response"] == 1.0, told
            memory = system["memory"]
            assert memory["in_flight_when_measured"] == memory["streams"] == memory["clean"]
            assert set(memory["kb_per_stream"]) == {"api", "workers"}
        if name != "direct":
            assert {"ttft_ms", "gap_ms"} <= set(system["added"]["1"])
            cost = system["cpu"]  # its process tree's CPU (api/bench/cpu.py)
            for level, streamed in cost["streams"].items():
                waves = -(-result["plan"]["cost_min_streams"] // int(level))  # each level's streams, in waves
                assert streamed["clean"] == int(level) * waves and streamed["us_per_token"] > 0, (name, cost)
                assert streamed["tokens"] == streamed["clean"] * result["plan"]["cost_tokens"], (name, cost)
                assert streamed["load_us_per_token"] >= 0, (name, cost)  # lean: may be under a tick
            assert cost["foreground"]["errors"] == 0 and cost["foreground"]["ms_per_response"] > 0, cost
            assert cost["idle_cores"] >= 0
            if name.startswith("respool"):
                assert cost["background"]["errors"] == 0 and cost["ms_per_poll"] > 0, cost
                assert cost["background"]["ms_per_response"] is not None, cost
                paced = cost["foreground_paced"]  # foreground requests at the background rate
                assert paced["errors"] == 0 and paced["completed"] > 0 and paced["ms_per_response"] > 0, cost
        else:
            assert "cpu" not in system  # the upstream stands for the GPU: its cost is not measured
    assert result["systems"]["respool (2 workers)"]["memory"]["processes"] == {"api": 1, "workers": 2}
    assert (out / "latency.png").read_bytes().startswith(PNG_MAGIC)
    assert (out / "cpu.png").read_bytes().startswith(PNG_MAGIC)
    assert (out / "table.md").read_text().startswith("| | direct |")


def test_the_printed_table_keeps_every_figure_whole_however_narrow_the_output(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Printed into a pipe or a log (80 columns: no terminal to ask), the table is as wide as its
    figures need: rich cut them to fit ("19…" for 198.1, "1…" for 110.1)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    systems = ["direct", "litellm", "respool (1 worker)", "respool (2 workers)"]
    result = {
        "systems": {name: {} for name in systems},
        "rows": {
            "CPU µs per token @30": {
                "direct": None,
                "litellm": 1320.5,
                "respool (1 worker)": 198.1,
                "respool (2 workers)": 164.0,
            },
            "CPU ms per short request, at the background rate": {
                "respool (1 worker)": 4.1,
                "respool (2 workers)": 3.8,
            },
        },
    }
    report.print_table(result)
    printed = capsys.readouterr().out
    for figure in ("1320.5", "198.1", "164.0", "4.1", "3.8", "170", "respool (1 worker)"):
        assert figure in printed, (figure, printed)
    assert "…" not in printed, printed
