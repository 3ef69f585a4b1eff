"""Stacked bar charts as hand-written SVG, drawn on the server: no script, no library, works without JS.

Colours come from CSS classes (`series-0` ...), so the chart follows the console's stylesheet. Each
segment carries a <title> (the browser's tooltip), and the figure a text summary for screen readers;
pages show the same numbers in a table beside it.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

WIDTH, HEIGHT = 720, 240
LEFT, RIGHT, TOP, BOTTOM = 56, 8, 12, 28
MAX_X_LABELS = 8
PALETTE_SIZE = 8  # classes series-0 .. series-7 in console.css


@dataclass(frozen=True)
class Series:
    label: str
    values: Sequence[int]


def nice_ceiling(value: float) -> int:
    """The smallest 1, 2 or 5 times a power of ten that is at least `value` (at least 1)."""
    if value <= 1:
        return 1
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * power >= value:
            return int(step * power)
    return int(10 * power)


def _day_label(day: dt.date) -> str:
    return f"{day.strftime('%b')} {day.day}"


def stacked_bars(
    chart_id: str, title: str, days: Sequence[dt.date], series: Sequence[Series], unit: str
) -> Markup:
    """A <figure> with the SVG chart and its legend: one bar per day, one segment per series."""
    totals = [sum(s.values[i] for s in series) for i in range(len(days))]
    top = nice_ceiling(max(totals, default=0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    band = plot_w / max(1, len(days))
    bar = max(1.0, band * 0.7)
    parts: list[str] = []

    for i in range(5):  # gridlines and y labels at 0, 1/4, ..., top
        value = top * i / 4
        y = TOP + plot_h - plot_h * i / 4
        label = f"{value:,.0f}" if value == int(value) else f"{value:,.1f}"
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text class="axis" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')

    every = max(1, math.ceil(len(days) / MAX_X_LABELS))
    for i, day in enumerate(days):
        x = LEFT + band * i + (band - bar) / 2
        base = float(TOP + plot_h)
        for index, s in enumerate(series):
            value = s.values[i]
            if value <= 0:
                continue
            height = plot_h * value / top
            base -= height
            tip = f"{day.isoformat()} · {s.label}: {value:,} {unit}"
            parts.append(
                f'<rect class="series-{index % PALETTE_SIZE}" x="{x:.1f}" y="{base:.1f}" '
                f'width="{bar:.1f}" height="{height:.1f}"><title>{escape(tip)}</title></rect>'
            )
        if i % every == 0:
            parts.append(
                f'<text class="axis" x="{x + bar / 2:.1f}" y="{HEIGHT - 8}" text-anchor="middle">'
                f"{escape(_day_label(day))}</text>"
            )
    if not any(totals):
        parts.append(
            f'<text class="empty" x="{LEFT + plot_w / 2:.1f}" y="{TOP + plot_h / 2:.1f}" '
            'text-anchor="middle">No usage in this period</text>'
        )

    total = sum(totals)
    span = f"{days[0].isoformat()} to {days[-1].isoformat()}" if days else "no days"
    summary = f"{total:,} {unit} in total from {span}" + (
        "; " + ", ".join(f"{s.label}: {sum(s.values):,}" for s in series) if series and total else ""
    )
    legend = "".join(
        f'<li><span class="swatch series-{i % PALETTE_SIZE}" aria-hidden="true"></span>{escape(s.label)}</li>'
        for i, s in enumerate(series)
    )
    svg = (
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-labelledby="{chart_id}-title {chart_id}-desc" preserveAspectRatio="xMidYMid meet">'
        f'<title id="{chart_id}-title">{escape(title)}</title>'
        f'<desc id="{chart_id}-desc">{escape(summary)}</desc>' + "".join(parts) + "</svg>"
    )
    return Markup(
        f'<figure class="chart-figure" id="{chart_id}">{svg}'
        f'<figcaption><ul class="legend">{legend}</ul></figcaption></figure>'
    )


def day_range(since: dt.date, until: dt.date) -> list[dt.date]:
    return [since + dt.timedelta(days=i) for i in range((until - since).days + 1)]
