"""What a bench run tells: `result.json`, a table on the terminal and in `table.md`, `latency.png`
(latency against the number of concurrent streams, one line per system) and `cpu.png` (what each
system's process tree costs in CPU, a bar per system, beside issue 20's targets)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt
import orjson
from rich.console import Console
from rich.table import Table

# The targets of issue 6 (a 2-core machine running upstream, respool and load together).
TARGETS = {
    "added TTFT p50 @1 (ms)": 5.0,
    "added TTFT p99 @1 (ms)": 20.0,
    "added gap p50 @1 (ms)": 1.0,
    "streams held (64 tok, 20 ms)": 100,
    "background short/s": 300,
    "KB per stream, API": 100,
    "KB per stream, worker": 100,
    # Issue 20's, for a system's whole process tree (api/bench/cpu.py).
    "CPU µs per token @30": 170,
    "CPU µs per token @100": 170,
    "CPU ms per short request": 5,
    "CPU ms per background response": 5,
    "idle CPU (% of a core)": 1,
}


def write(result: dict[str, Any], out_dir: Path) -> None:
    """Write the JSON and the PNG, and print the table."""
    result["rows"] = rows(result)
    (out_dir / "result.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    (out_dir / "table.md").write_text(markdown(result))
    draw(result, out_dir / "latency.png")
    draw_cost(result, out_dir / "cpu.png")
    print_table(result)


def rows(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The headline figures: {row: {system: value}} (None where a system has no such figure)."""
    table: dict[str, dict[str, Any]] = {}
    concurrent = str(result["plan"]["concurrent"])
    for name, system in result["systems"].items():
        figures = {
            "TTFT p50 @1 (ms)": _get(system, "latency", "1", "ttft_ms", "p50"),
            "TTFT p99 @1 (ms)": _get(system, "latency", "1", "ttft_ms", "p99"),
            "added TTFT p50 @1 (ms)": _get(system, "added", "1", "ttft_ms", "p50"),
            "added TTFT p99 @1 (ms)": _get(system, "added", "1", "ttft_ms", "p99"),
            "added gap p50 @1 (ms)": _get(system, "added", "1", "gap_ms", "p50"),
            "added gap p99 @1 (ms)": _get(system, "added", "1", "gap_ms", "p99"),
            f"added TTFT p50 @{concurrent} (ms)": _get(system, "added", concurrent, "ttft_ms", "p50"),
            f"added TTFT p99 @{concurrent} (ms)": _get(system, "added", concurrent, "ttft_ms", "p99"),
            f"added gap p50 @{concurrent} (ms)": _get(system, "added", concurrent, "gap_ms", "p50"),
            f"added gap p99 @{concurrent} (ms)": _get(system, "added", concurrent, "gap_ms", "p99"),
            "streams held (64 tok, 20 ms)": system.get("max_streams_held"),
            "foreground short/s": _get(system, "short", "foreground", "per_second"),
            "background short/s": _get(system, "short", "background", "per_second"),
            "background short/s, webhooks": _get(system, "short", "webhooks", "per_second"),
            "background latency p50 (ms)": _get(system, "short", "background", "latency_ms", "p50"),
            "background latency p50 (ms), webhooks": _get(system, "short", "webhooks", "latency_ms", "p50"),
            "requests per background response": _get(system, "short", "background", "requests_per_response"),
            "requests per background response, webhooks": _get(
                system, "short", "webhooks", "requests_per_response"
            ),
            "KB per stream, API": _get(system, "memory", "kb_per_stream", "api"),
            "KB per stream, worker": _get(system, "memory", "kb_per_stream", "workers"),
            "KB per stream, LiteLLM": _get(system, "memory", "kb_per_stream", "litellm"),
        }
        for level in result["plan"].get("cost_streams", ()):
            figures[f"CPU µs per token @{level}"] = _get(system, "cpu", "streams", str(level), "us_per_token")
        figures["CPU ms per short request"] = _get(system, "cpu", "foreground", "ms_per_response")
        figures["CPU ms per background response"] = _get(system, "cpu", "background", "ms_per_response")
        figures["CPU ms per short request, at the background rate"] = _get(
            system, "cpu", "foreground_paced", "ms_per_response"
        )
        figures["CPU ms per poll"] = _get(system, "cpu", "ms_per_poll")
        idle = _get(system, "cpu", "idle_cores")
        figures["idle CPU (% of a core)"] = None if idle is None else round(idle * 100, 2)
        for level in result["plan"].get("cost_streams", ()):
            figures[f"load generator µs per token @{level}"] = _get(
                system, "cpu", "streams", str(level), "load_us_per_token"
            )
        for row, value in figures.items():
            table.setdefault(row, {})[name] = value
    return table | _relative(table)


# The rows whose cost is also given as a fraction of LiteLLM's in the same run: the machine's speed
# drifts by as much as 2.8x within a day, and both systems' costs move with it (README, CPU cost).
_RELATIVE_ROWS = ("CPU µs per token @", "CPU ms per short request", "CPU ms per background response")
_REFERENCE = "litellm"


def _relative(table: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each system's CPU cost over LiteLLM's, per row of `_RELATIVE_ROWS` that LiteLLM has."""
    relative: dict[str, dict[str, Any]] = {}
    for row, values in table.items():
        reference = values.get(_REFERENCE)
        if not row.startswith(_RELATIVE_ROWS) or not reference:
            continue
        label = row.replace(" µs", "").replace(" ms", "")
        relative[f"{label}, over LiteLLM's"] = {
            name: None if value is None or name == _REFERENCE else round(value / reference, 3)
            for name, value in values.items()
        }
    return relative


def _get(data: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def print_table(result: dict[str, Any]) -> None:
    systems = list(result["systems"])
    table = Table(title="respool bench (ms, per second, KB)")
    table.add_column("", no_wrap=True)
    for name in systems:
        table.add_column(name, justify="right")
    table.add_column("target", justify="right")
    for row, values in result["rows"].items():
        if all(value is None for value in values.values()):
            continue
        target = TARGETS.get(row)
        table.add_row(
            row, *(_cell(values.get(name)) for name in systems), "" if target is None else f"{target:g}"
        )
    console = Console()
    needed = console.measure(table, options=console.options.update_width(1000)).maximum
    if needed > console.width:  # never a figure cut to "19…": a pipe or a log is 80 columns wide
        console = Console(width=needed)
    console.print(table)
    for name, why in result.get("skipped", {}).items():
        console.print(f"{name}: skipped: {why}")


def markdown(result: dict[str, Any]) -> str:
    """The table as Markdown (for a README)."""
    systems = list(result["systems"])
    lines = ["| | " + " | ".join(systems) + " | target |", "|---" * (len(systems) + 2) + "|"]
    for row, values in result["rows"].items():
        if all(value is None for value in values.values()):
            continue
        target = TARGETS.get(row)
        cells = [_cell(values.get(name)) for name in systems] + ["" if target is None else f"{target:g}"]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def draw(result: dict[str, Any], path: Path) -> None:
    """TTFT p50 and gap p99 against concurrent streams (64 tokens 20 ms apart), per system."""
    figure, (ttft_axes, gap_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    measured: set[int] = set()
    for name, system in result["systems"].items():
        points = {int(level): summary for level, summary in system.get("levels", {}).items()}
        if not points:
            continue
        levels = sorted(points)
        measured.update(levels)
        ttft = [points[level]["ttft_ms"]["p50"] for level in levels]
        gap = [points[level]["gap_ms"]["p99"] for level in levels]
        ttft_axes.plot(levels, ttft, marker="o", label=name)
        gap_axes.plot(levels, gap, marker="o", label=name)
    ttft_axes.set(title="time to first token, p50", xlabel="concurrent streams", ylabel="ms", yscale="log")
    gap_axes.set(title="gap between tokens, p99", xlabel="concurrent streams", ylabel="ms", yscale="log")
    for axes in (ttft_axes, gap_axes):
        axes.set_xscale("log")
        axes.set_xticks(sorted(measured), [str(level) for level in sorted(measured)])
        axes.minorticks_off()
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    figure.suptitle(f"respool bench, {result['machine']['cpus']} CPUs, {result['machine']['date']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


@dataclass(frozen=True)
class CostPanel:
    """One panel of `cpu.png`: a bar per system for each of `labels` (None: not measured for it)."""

    title: str
    unit: str
    labels: tuple[str, ...]
    bars: dict[str, list[float | None]]
    target: float | None = None


def cost_panels(result: dict[str, Any]) -> list[CostPanel]:
    """The CPU figures of a run as `cpu.png` draws them: per relayed token, per response, and the load
    generator's own per token; systems without any figure of a panel are left out of it."""
    levels = [str(level) for level in result["plan"].get("cost_streams", ())]
    per_response = (
        ("short", ("foreground", "ms_per_response")),
        ("background", ("background", "ms_per_response")),
        ("short, at the\nbackground rate", ("foreground_paced", "ms_per_response")),
        ("poll", ("ms_per_poll",)),
    )

    def panel(
        title: str, unit: str, labels: tuple[str, ...], paths: list[tuple[str, ...]], target: float | None
    ) -> CostPanel:
        bars: dict[str, list[float | None]] = {}
        for name, system in result["systems"].items():
            values = [_get(system, "cpu", *path) for path in paths]
            if any(value is not None for value in values):
                bars[name] = values
        return CostPanel(title, unit, labels, bars, target)

    return [
        panel(
            "CPU per relayed token",
            "µs",
            tuple(f"{level} streams" for level in levels),
            [("streams", level, "us_per_token") for level in levels],
            TARGETS["CPU µs per token @30"],
        ),
        panel(
            "CPU per response",
            "ms",
            tuple(label for label, _ in per_response),
            [path for _, path in per_response],
            TARGETS["CPU ms per short request"],
        ),
        panel(
            "the load generator's CPU per token",
            "µs",
            tuple(f"{level} streams" for level in levels),
            [("streams", level, "load_us_per_token") for level in levels],
            None,
        ),
    ]


def draw_cost(result: dict[str, Any], path: Path) -> None:
    """`cost_panels` as grouped bars on a linear scale (a bar's height is its cost, however small beside
    LiteLLM's), each labelled with its figure, each target a dashed line."""
    panels = cost_panels(result)
    figure, axes_row = plt.subplots(1, len(panels), figsize=(16, 4.8))
    for axes, panel in zip(axes_row, panels, strict=True):
        width = 0.8 / max(1, len(panel.bars))
        for index, (name, values) in enumerate(panel.bars.items()):
            xs = [
                position + (index - (len(panel.bars) - 1) / 2) * width
                for position in range(len(panel.labels))
            ]
            shown = [(x, value) for x, value in zip(xs, values, strict=True) if value is not None]
            if not shown:
                continue
            drawn = axes.bar([x for x, _ in shown], [value for _, value in shown], width, label=name)
            axes.bar_label(drawn, [_cell(value) for _, value in shown], fontsize=7)
        if panel.target is not None:
            target = f"target ({_cell(panel.target)} {panel.unit})"
            axes.axhline(panel.target, color="black", linestyle="--", linewidth=1, label=target)
        axes.set_xticks(range(len(panel.labels)), panel.labels)
        axes.set(title=panel.title, ylabel=panel.unit)
        axes.margins(y=0.12)  # room for the labels over the tallest bars
        axes.grid(True, axis="y", alpha=0.3)
        if panel.bars:  # under the panel: over it, it would hide the tallest bars' figures
            axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    figure.suptitle(
        f"respool bench: CPU of each system's process tree, {result['machine']['cpus']} CPUs, "
        f"{result['machine']['date']}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
