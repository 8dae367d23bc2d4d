"""A line plot as a PNG with Pillow (a pinned dependency already; matplotlib is not installed): one line per
series, axes from zero with round ticks, a legend. Enough for a benchmark's figure in bench/RESULTS.md."""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f"]
WIDTH, HEIGHT = 900, 560
LEFT, RIGHT, TOP, BOTTOM = 90, 30, 60, 80


def nice_step(span: float, ticks: int = 6) -> float:
    """A round tick step (1, 2 or 5 times a power of ten) that cuts ``span`` into about ``ticks`` parts."""
    raw = span / ticks if span > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def line_plot(series: dict[str, list[tuple[float, float]]], path: Path, title: str, x_label: str,
              y_label: str) -> Path:
    """``series``: name -> points ``(x, y)``; writes ``path`` (PNG) and returns it."""
    font = ImageFont.load_default(size=15)
    small = ImageFont.load_default(size=13)
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    points = [p for values in series.values() for p in values]
    x_step = nice_step(max((x for x, _ in points), default=1))
    y_step = nice_step(max((y for _, y in points), default=1))
    x_max = x_step * math.ceil(max((x for x, _ in points), default=1) / x_step)
    y_max = y_step * math.ceil(max((y for _, y in points), default=1) / y_step)

    def at(x: float, y: float) -> tuple[float, float]:
        return (LEFT + x / x_max * (WIDTH - LEFT - RIGHT), HEIGHT - BOTTOM - y / y_max * (HEIGHT - TOP - BOTTOM))

    for i in range(round(y_max / y_step) + 1):  # horizontal grid and y ticks
        y = i * y_step
        draw.line([at(0, y), at(x_max, y)], fill="#e5e5e5")
        draw.text((LEFT - 8, at(0, y)[1]), f"{y:g}", fill="black", font=small, anchor="rm")
    for i in range(round(x_max / x_step) + 1):
        x = i * x_step
        draw.line([at(x, 0), (at(x, 0)[0], at(x, 0)[1] + 5)], fill="black")
        draw.text((at(x, 0)[0], at(x, 0)[1] + 8), f"{x:g}", fill="black", font=small, anchor="ma")
    draw.line([at(0, 0), at(x_max, 0)], fill="black")
    draw.line([at(0, 0), at(0, y_max)], fill="black")
    draw.text((WIDTH / 2, 20), title, fill="black", font=font, anchor="ma")
    draw.text(((LEFT + WIDTH - RIGHT) / 2, HEIGHT - 30), x_label, fill="black", font=font, anchor="ma")
    label = Image.new("RGB", (HEIGHT - TOP - BOTTOM, 24), "white")
    ImageDraw.Draw(label).text((label.width / 2, 2), y_label, fill="black", font=font, anchor="ma")
    image.paste(label.rotate(90, expand=True), (14, TOP))
    for number, (name, values) in enumerate(series.items()):
        colour = COLOURS[number % len(COLOURS)]
        xy = [at(x, y) for x, y in sorted(values)]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=3)
        for x, y in xy:
            draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=colour)
        legend_y = TOP + 4 + 22 * number
        draw.line([(LEFT + 16, legend_y + 8), (LEFT + 46, legend_y + 8)], fill=colour, width=3)
        draw.text((LEFT + 54, legend_y), name, fill="black", font=small)
    image.save(path)
    return path
