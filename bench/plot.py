"""Line charts as PNG with Pillow alone (no matplotlib in the environment): stacked panels sharing one time axis.

    draw_panels([Panel("worker RSS (MB)", {"text": [(t, mb), ...], "vision": [...]})], "out.png", "title")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

WIDTH, PANEL_HEIGHT = 1200, 260
LEFT, RIGHT, TOP, BOTTOM = 90, 30, 40, 36
COLOURS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]


@dataclass
class Panel:
    """One chart: a y-axis label and named series of (x, y) points; ``limit`` draws a dashed target line."""

    label: str
    series: dict[str, list[tuple[float, float]]]
    limit: float | None = None
    marks: list[float] = field(default_factory=list)  # x positions of vertical event lines (storms, ...)
    dotted: set[str] = field(default_factory=set)     # series drawn as dots


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round values covering [low, high]."""
    if high <= low:
        high = low + 1
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * step:
            step *= factor
            break
    first = math.floor(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 2) if first + i * step <= high + step]


def draw_panels(panels: list[Panel], path: Path | str, title: str, x_label: str = "minutes") -> None:
    height = TOP + len(panels) * PANEL_HEIGHT + BOTTOM
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=14)
    draw.text((LEFT, 10), title, fill="black", font=font)
    xs = [x for panel in panels for points in panel.series.values() for x, _ in points]
    # one colour per series' first word, the same in every panel ("text" and "text KV" share one)
    bases = sorted({name.split()[0] for panel in panels for name in panel.series})
    colours = {base: COLOURS[number % len(COLOURS)] for number, base in enumerate(bases)}
    x_low, x_high = (min(xs), max(xs)) if xs else (0.0, 1.0)
    for index, panel in enumerate(panels):
        top = TOP + index * PANEL_HEIGHT
        _draw_panel(draw, font, panel, (LEFT, top + 10, WIDTH - RIGHT, top + PANEL_HEIGHT - 30), (x_low, x_high),
                    x_label if index == len(panels) - 1 else "", colours)
    image.save(path)


def _draw_panel(draw: ImageDraw.ImageDraw, font, panel: Panel, box: tuple[int, int, int, int],
                x_range: tuple[float, float], x_label: str, colours: dict[str, tuple[int, int, int]]) -> None:
    left, top, right, bottom = box
    ys = [y for points in panel.series.values() for _, y in points] + ([panel.limit] if panel.limit else [])
    y_range = (0.0, max(ys) * 1.1 if ys and max(ys) > 0 else 1.0)
    x_range = x_range if x_range[1] > x_range[0] else (x_range[0], x_range[0] + 1)

    def at(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x_range[0]) / (x_range[1] - x_range[0]) * (right - left),
                bottom - (y - y_range[0]) / (y_range[1] - y_range[0]) * (bottom - top))

    draw.rectangle(box, outline=(90, 90, 90))
    _draw_axes(draw, font, box, x_range, y_range, at)
    for mark in panel.marks:
        x, _ = at(mark, y_range[0])
        draw.line([(x, top), (x, bottom)], fill=(200, 200, 200), width=1)
    if panel.limit is not None:
        _, y = at(x_range[0], panel.limit)
        for start in range(left, right, 12):
            draw.line([(start, y), (min(start + 6, right), y)], fill=(120, 120, 120), width=1)
    for number, (name, points) in enumerate(sorted(panel.series.items())):
        colour = colours[name.split()[0]]
        if name in panel.dotted:
            for x, y in points:
                px, py = at(x, y)
                draw.ellipse([px - 1.5, py - 1.5, px + 1.5, py + 1.5], fill=colour)
        elif len(points) > 1:
            draw.line([at(x, y) for x, y in points], fill=colour, width=2)
        draw.text((right - 10 - 120 * number, top + 6), f"- {name}", fill=colour, font=font, anchor="ra")
    draw.text((left + 8, top + 6), panel.label, fill="black", font=font)
    if x_label:
        draw.text(((left + right) / 2, bottom + 20), x_label, fill="black", font=font, anchor="mt")


def _draw_axes(draw: ImageDraw.ImageDraw, font, box: tuple[int, int, int, int], x_range: tuple[float, float],
               y_range: tuple[float, float], at) -> None:
    """Grid lines and tick labels."""
    left, _, right, bottom = box
    for tick in nice_ticks(*y_range):
        if y_range[0] <= tick <= y_range[1]:
            _, y = at(x_range[0], tick)
            draw.line([(left, y), (right, y)], fill=(230, 230, 230))
            draw.text((left - 8, y), f"{tick:g}", fill="black", font=font, anchor="rm")
    for tick in nice_ticks(*x_range, 10):
        if x_range[0] <= tick <= x_range[1]:
            x, _ = at(tick, y_range[0])
            draw.line([(x, bottom), (x, bottom + 4)], fill="black")
            draw.text((x, bottom + 6), f"{tick:g}", fill="black", font=font, anchor="mt")


def line_plot(series: dict[str, list[tuple[float, float]]], path: Path, title: str, x_label: str,
              y_label: str) -> Path:
    """One panel of ``series`` (name -> points ``(x, y)``) against ``x_label``; writes ``path`` (PNG), returns it."""
    draw_panels([Panel(y_label, {name: sorted(points) for name, points in series.items()})], path, title, x_label)
    return Path(path)
