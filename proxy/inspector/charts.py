"""Line charts as inline SVG, drawn on the server (no script, no library).

``line_chart`` takes series of ``(x, y)`` points and returns one ``<svg>`` element: axes with
their extreme values, one polyline per series, a dot per point (up to ``MAX_DOTS`` a series)
whose ``<title>`` (the browser's own tooltip) gives its values, vertical marks (``marks``: a
policy version's push; those outside the points' range are left out), and a legend. Every text
is escaped; the result is ``Markup`` for the templates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from markupsafe import Markup, escape

MAX_DOTS = 150
PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2")
_PAD_LEFT, _PAD_RIGHT, _PAD_TOP, _PAD_BOTTOM = 48, 12, 12, 34


@dataclass(frozen=True, slots=True)
class Series:
    label: str
    points: Sequence[tuple[float, float]]
    color: str = PALETTE[0]


@dataclass(frozen=True, slots=True)
class Chart:
    """What a chart shows and how its axes read."""

    title: str
    series: Sequence[Series]
    x_label: str = ""
    y_label: str = ""
    x_time: bool = False  # x is seconds since the epoch: ticks read as UTC times
    y_range: tuple[float, float] | None = None  # fixed (e.g. 0..1 for a success rate)
    marks: Sequence[tuple[float, str]] = field(default_factory=tuple)  # (x, label), in range


def _fmt(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if value == int(value):
        return str(int(value))
    return f"{value:.3g}"


def _time(value: float) -> str:
    return datetime.fromtimestamp(value, UTC).strftime("%m-%d %H:%M")


def _span(values: Sequence[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    if low == high:
        # Padded in proportion past 2**53, where low - 1 == low (a zero span divides by 0).
        pad = max(1.0, abs(low) / 1e6)
        return low - pad, high + pad
    return low, high


def line_chart(chart: Chart, *, width: int = 560, height: int = 200) -> Markup:
    """The chart as one ``<svg>`` element (a note instead when there is no point)."""
    points = [p for s in chart.series for p in s.points]
    title = escape(chart.title)
    if not points:
        return Markup(f'<p class="empty">{title}: no data yet.</p>')
    x0, x1 = _span([p[0] for p in points])
    y0, y1 = chart.y_range or _span([p[1] for p in points])
    plot_w = width - _PAD_LEFT - _PAD_RIGHT
    plot_h = height - _PAD_TOP - _PAD_BOTTOM

    def sx(x: float) -> float:
        return _PAD_LEFT + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return _PAD_TOP + (1 - (y - y0) / (y1 - y0)) * plot_h

    show_x: Callable[[float], str] = _time if chart.x_time else _fmt
    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" xmlns="http://www.w3.org/2000/svg"><title>{title}</title>',
        f'<rect x="{_PAD_LEFT}" y="{_PAD_TOP}" width="{plot_w}" height="{plot_h}" '
        'fill="#fafafa" stroke="#ccc"/>',
    ]
    for x, label in chart.marks:
        if not x0 <= x <= x1:
            continue  # a mark outside the points' range: not drawn
        px = sx(x)
        parts.append(
            f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{_PAD_TOP}" y2="{_PAD_TOP + plot_h}" '
            f'stroke="#bbb" stroke-dasharray="3 3"><title>{escape(label)}</title></line>'
        )
    for y in (y0, (y0 + y1) / 2, y1):
        parts.append(
            f'<text x="{_PAD_LEFT - 4}" y="{sy(y) + 4:.1f}" text-anchor="end" '
            f'class="tick">{escape(_fmt(y))}</text>'
        )
    base = _PAD_TOP + plot_h + 14
    parts.append(f'<text x="{_PAD_LEFT}" y="{base}" class="tick">{escape(show_x(x0))}</text>')
    parts.append(
        f'<text x="{_PAD_LEFT + plot_w}" y="{base}" text-anchor="end" class="tick">'
        f"{escape(show_x(x1))}</text>"
    )
    parts.append(
        f'<text x="{_PAD_LEFT + plot_w / 2:.1f}" y="{height - 4}" text-anchor="middle" '
        f'class="axis">{escape(chart.x_label)}</text>'
    )
    parts.append(
        f'<text x="12" y="{_PAD_TOP + plot_h / 2:.1f}" text-anchor="middle" class="axis" '
        f'transform="rotate(-90 12 {_PAD_TOP + plot_h / 2:.1f})">{escape(chart.y_label)}</text>'
    )
    legend_x = _PAD_LEFT + 8.0
    for s in chart.series:
        parts.append(_series(s, sx, sy, show_x))
        parts.append(
            f'<text x="{legend_x:.0f}" y="{_PAD_TOP + 14}" fill="{escape(s.color)}" '
            f'class="legend">{escape(s.label)}</text>'
        )
        legend_x += 16 + 6.2 * len(s.label)  # about the width of an 11px label
    parts.append("</svg>")
    return Markup("".join(parts))


def _series(
    s: Series,
    sx: Callable[[float], float],
    sy: Callable[[float], float],
    show_x: Callable[[float], str],
) -> str:
    pts = sorted(s.points)
    color = escape(s.color)
    coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
    out = [f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>']
    if len(pts) > MAX_DOTS:  # a dot (and its tooltip) per point would outweigh the page
        return "".join(out)
    for x, y in pts:
        tip = escape(f"{s.label}: {show_x(x)} -> {_fmt(y)}")
        out.append(
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}">'
            f"<title>{tip}</title></circle>"
        )
    return "".join(out)
