"""`python -m corelib trace-plot`: N consecutive decode steps of one or two traces as a PNG.

Each trace (``trace.json`` from ``engine.trace=true``) becomes one panel: a row per lane
(scheduler, polling, then the device streams), its spans as bars, and the
device's idle gaps between steps in red on the compute lane. Panels share one time scale,
so a sync trace above an async one shows where the device waits for the host.

    python -m corelib trace-plot sync/trace.json async/trace.json --steps 12 --out timeline.png

Reading and measuring traces needs only the standard library; drawing needs matplotlib
(the ``bench`` extra), imported only when a picture is drawn.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from corelib.errors import ConfigError
from corelib.observe.trace import DEVICE_PID, STEP_CATEGORY

DEFAULT_STEPS = 12
SKIP_STEPS = 2  # decode steps left out at the start of the steady decode by default
HOST_COLORS = {"schedule": "#457b9d", "pack": "#a8dadc", "submit": "#e76f51", "wait for tokens": "#cfcfcf",
               "postprocess": "#f4a261", "trace anchor": "#6c757d"}
STEP_COLORS = {"sync": "#e9c46a", "async": "#2a9d8f", "prefill": "#264653"}
COPY_COLOR = "#8d99ae"
GAP_COLOR = "#e5383b"
OTHER_COLOR = "#b5838d"


@dataclass(frozen=True)
class Span:
    lane: str
    is_device: bool
    name: str
    category: str
    start_ms: float
    duration_ms: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.duration_ms


@dataclass(frozen=True)
class Timeline:
    """One trace file: its spans in time order, its lanes in display order, and what ran."""

    path: Path
    spans: list[Span]
    lanes: list[tuple[bool, str]]  # (is_device, name), host lanes first
    metadata: dict[str, Any]

    def label(self) -> str:
        meta = self.metadata
        if "async_token_handoff" not in meta:
            return self.path.parent.name or self.path.stem
        mode = "async handoff" if meta["async_token_handoff"] else "sync handoff"
        return f"{mode} ({meta.get('backend')}/{meta.get('runtime')}, {meta.get('model')})"


@dataclass(frozen=True)
class Window:
    """The steps shown and what the device did meanwhile."""

    steps: list[Span]
    start_ms: float
    end_ms: float
    gaps: list[tuple[float, float]]  # (start, end) of each idle stretch of the compute lane

    @property
    def idle_ms(self) -> float:
        return sum(end - start for start, end in self.gaps)

    @property
    def occupancy(self) -> float:
        wall = self.end_ms - self.start_ms
        return 1.0 - self.idle_ms / wall if wall > 0 else 1.0

    @property
    def ms_per_step(self) -> float:
        return (self.end_ms - self.start_ms) / len(self.steps)

    def summary(self) -> str:
        gaps = [(end - start) * 1e3 for start, end in self.gaps]
        median = f"{statistics.median(gaps):.0f} µs" if gaps else "none"
        return (f"{len(self.steps)} decode steps, {self.ms_per_step:.3f} ms/step, device busy "
                f"{100 * self.occupancy:.1f} %, median idle gap {median}")


def load_trace(path: Path) -> Timeline:
    """Read a corelib trace; a file that is not one fails in one line."""
    try:
        data = json.loads(path.read_text())
        events = data["traceEvents"]
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such trace file; take one with engine.trace=true") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise ConfigError(f"{path} is not a Chrome trace JSON file ({type(error).__name__}: {error})") from None
    if not isinstance(events, list):
        raise ConfigError(f"{path}: traceEvents is a {type(events).__name__}, not a list of events")
    names: dict[tuple[int, int], str] = {}
    order: dict[tuple[int, int], int] = {}
    found: list[tuple[tuple[int, int], Span]] = []  # each span with its (pid, tid); lanes are named below
    for index, event in enumerate(events):
        try:
            _read_event(event, names, order, found)
        except KeyError as error:
            raise ConfigError(f"{path}: trace event {index} has no {error}; is it a corelib trace.json?") from None
        except (TypeError, ValueError, AttributeError) as error:
            raise ConfigError(f"{path}: trace event {index} is malformed ({error}); is it a corelib trace.json?"
                              ) from None
    spans = []
    for key, span in found:
        names.setdefault(key, f"{key[0]}/{key[1]}")
        spans.append(replace(span, lane=names[key]))
    spans.sort(key=lambda s: s.start_ms)
    keys = sorted(names, key=lambda k: (k[0] == DEVICE_PID, order.get(k, 0), k[1]))
    lanes = [(k[0] == DEVICE_PID, names[k]) for k in keys]
    other = data.get("otherData") if isinstance(data, dict) else None
    metadata = other.get("corelib") if isinstance(other, dict) else None
    return Timeline(path, spans, lanes, metadata if isinstance(metadata, dict) else {})


def _read_event(event: Any, names: dict[tuple[int, int], str], order: dict[tuple[int, int], int],
                found: list[tuple[tuple[int, int], Span]]) -> None:
    """One trace event into lane names, lane order or a span; raises on a missing or mistyped field."""
    if not isinstance(event, dict):
        raise TypeError(f"a {type(event).__name__}, not an object")
    key = (int(event.get("pid", 0)), int(event.get("tid", 0)))
    phase, name = event.get("ph"), event.get("name")
    if phase == "M" and name == "thread_name":
        names[key] = str(event["args"]["name"])
    elif phase == "M" and name == "thread_sort_index":
        order[key] = int(event["args"]["sort_index"])
    elif phase == "X":
        args = event.get("args", {})
        if not isinstance(args, dict):
            raise TypeError(f"its args are a {type(args).__name__}, not an object")
        found.append((key, Span(lane="", is_device=key[0] == DEVICE_PID, name=str(event["name"]),
                                category=str(event.get("cat", "")), start_ms=float(event["ts"]) / 1e3,
                                duration_ms=float(event.get("dur", 0.0)) / 1e3, args=args)))


def select_window(timeline: Timeline, num_steps: int, first_step: int | None = None) -> Window:
    """``num_steps`` consecutive decode steps: from step ``first_step``, or early in the steady decode."""
    if num_steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {num_steps}")
    steps = [s for s in timeline.spans if s.category == STEP_CATEGORY]
    if not steps:
        raise ConfigError(f"{timeline.path} has no device step spans (was the device's event timing off?)")
    if first_step is not None:
        index = next((i for i, s in enumerate(steps) if s.args.get("step") == first_step), None)
        if index is None:
            raise ConfigError(f"{timeline.path} has no step {first_step}; it has steps "
                              f"{steps[0].args.get('step')}..{steps[-1].args.get('step')}")
    else:
        steady = [i for i in range(1, len(steps)) if _is_decode(steps[i]) and _is_decode(steps[i - 1])]
        if not steady:
            raise ConfigError(f"{timeline.path} has no two consecutive decode steps to show")
        # Early in the steady decode, but far enough from the end to show num_steps when there are that many.
        index = steady[min(SKIP_STEPS, len(steady) - 1, max(0, len(steady) - num_steps))]
    chosen = [s for s in steps[index:] if _is_decode(s)][:num_steps]
    if not chosen:
        raise ConfigError(f"{timeline.path}: no decode step from step {steps[index].args.get('step')} on")
    start, end = chosen[0].start_ms, chosen[-1].end_ms
    lane = chosen[0].lane
    busy = [s for s in timeline.spans if s.is_device and s.lane == lane and s.end_ms > start and s.start_ms < end]
    gaps = []
    reached = start
    for span in busy:
        if span.start_ms > reached:
            gaps.append((reached, span.start_ms))
        reached = max(reached, span.end_ms)
    return Window(chosen, start, end, gaps)


def _is_decode(span: Span) -> bool:
    return span.args.get("kind") == "decode"


def _color(span: Span) -> str:
    if span.category == STEP_CATEGORY:
        return STEP_COLORS["prefill"] if not _is_decode(span) else STEP_COLORS.get(span.args.get("path", ""),
                                                                                 OTHER_COLOR)
    if span.is_device:
        return COPY_COLOR
    return HOST_COLORS.get(span.name, OTHER_COLOR)


def render(timelines: Sequence[Timeline], windows: Sequence[Window], out: Path,
           labels: Sequence[str] | None = None) -> Path:
    """Draw one panel per trace, on one time scale, and save a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError("trace-plot draws with matplotlib, which is not installed: "
                          "pip install 'corelib[bench]'") from None
    span_ms = max(w.end_ms - w.start_ms for w in windows)
    margin = 0.03 * span_ms
    heights = [max(len(t.lanes), 1) * 0.42 + 0.9 for t in timelines]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(14, sum(heights) + 0.8), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    used: dict[str, str] = {}
    for i, (timeline, window) in enumerate(zip(timelines, windows, strict=True)):
        ax = axes[i][0]
        rows = {lane: row for row, lane in enumerate(timeline.lanes)}
        lo, hi = window.start_ms - margin, window.start_ms + span_ms + margin
        compute = (True, window.steps[0].lane)
        for span in timeline.spans:
            if span.end_ms < lo or span.start_ms > hi:
                continue
            row = rows.get((span.is_device, span.lane))
            if row is None:
                continue
            color = _color(span)
            # A white edge keeps back-to-back steps apart; short host spans would vanish in one.
            edge = "white" if span.category == STEP_CATEGORY else "none"
            ax.broken_barh([(span.start_ms - window.start_ms, max(span.duration_ms, span_ms * 1e-4))],
                           (row - 0.38, 0.76), facecolors=color, edgecolors=edge, linewidth=0.6)
            used.setdefault(_legend_name(span), color)
        gap_row = rows[compute]
        for start, end in window.gaps:
            ax.broken_barh([(start - window.start_ms, end - start)], (gap_row - 0.45, 0.9), facecolors=GAP_COLOR,
                           edgecolors="none")
        if window.gaps:
            used.setdefault("device idle", GAP_COLOR)
        ax.set_yticks(range(len(timeline.lanes)))
        ax.set_yticklabels([("device: " if dev else "") + name for dev, name in timeline.lanes])
        ax.set_ylim(len(timeline.lanes) - 0.5, -0.5)
        ax.set_xlim(-margin, span_ms + margin)
        label = labels[i] if labels and i < len(labels) else timeline.label()
        ax.set_title(f"{label}: {window.summary()}", fontsize=10, loc="left")
        ax.grid(axis="x", color="#e0e0e0", linewidth=0.6)
        ax.set_axisbelow(True)
    axes[-1][0].set_xlabel("ms from the first step shown")
    handles = [Patch(facecolor=color, label=name) for name, color in used.items()]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _legend_name(span: Span) -> str:
    if span.category == STEP_CATEGORY:
        return f"decode step ({span.args.get('path')})" if _is_decode(span) else "prefill step"
    if span.is_device:
        return "device copy"
    return span.name if span.name in HOST_COLORS else "other host span"


def plot_traces(paths: Sequence[Path], out: Path, num_steps: int = DEFAULT_STEPS, first_step: int | None = None,
                labels: Sequence[str] | None = None) -> tuple[Path, list[Window]]:
    timelines = [load_trace(p) for p in paths]
    windows = [select_window(t, num_steps, first_step) for t in timelines]
    return render(timelines, windows, out, labels), windows


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m corelib trace-plot",
        description="Render N consecutive decode steps of one or two trace.json files (engine.trace=true) "
                    "into a PNG that shows the device's idle gaps.")
    parser.add_argument("traces", nargs="+", type=Path, help="trace.json files; one panel each (two: compare)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="decode steps to show (default 12)")
    parser.add_argument("--first-step", type=int, default=None,
                        help="step id to start at (default: early in the steady decode)")
    parser.add_argument("--labels", nargs="+", default=None, help="panel titles, one per trace")
    parser.add_argument("--out", type=Path, default=Path("timeline.png"), help="PNG to write (default timeline.png)")
    args = parser.parse_args(list(argv))
    if len(args.traces) > 4:
        raise ConfigError(f"trace-plot shows at most 4 traces, got {len(args.traces)}")
    out, windows = plot_traces(args.traces, args.out, args.steps, args.first_step, args.labels)
    for path, window in zip(args.traces, windows, strict=True):
        print(f"corelib: {path}: {window.summary()}")
    print(f"corelib: wrote {out}")
    return 0
