"""Small dependency-free SVG pictures: the loss curve and the expert load of every MoE layer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

WIDTH, HEIGHT, PAD = 640, 360, 48


EXTRA_COLOURS = ("#ff7f0e", "#2ca02c", "#d62728", "#9467bd")
MARKER_MAX_POINTS = 64  # a series this short (e.g. validation every N steps) also gets a dot per point


def _finite_points(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[tuple[float, float]], int]:
    """The (x, y) pairs with both coordinates finite, and how many were left out (NaN or inf is no position)."""
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if math.isfinite(x) and math.isfinite(y)]
    return points, len(xs) - len(points)


def line_chart_svg(
    xs: Sequence[float],
    ys: Sequence[float],
    title: str,
    x_label: str,
    y_label: str,
    extra: Sequence[tuple[str, Sequence[float], Sequence[float]]] = (),
    label: str | None = None,
) -> str:
    """A line chart of ``ys`` over ``xs``, plus ``extra`` series ``(label, xs, ys)`` in other colours.

    With ``extra`` a legend names each series (the main one ``label``, default ``title``); the axes cover all
    series. Non-finite values are not drawn, and a note says how many were left out.
    """
    main, skipped = _finite_points(xs, ys)
    others = []
    for i, (name, exs, eys) in enumerate(extra):
        points, n = _finite_points(exs, eys)
        others.append((name, points, EXTRA_COLOURS[i % len(EXTRA_COLOURS)]))
        skipped += n
    every = main + [p for _, points, _ in others for p in points] or [(0.0, 0.0)]
    all_x, all_y = [x for x, _ in every], [y for _, y in every]
    x0, x1 = min(all_x), max(all_x) if len(all_x) > 1 else min(all_x) + 1
    y0, y1 = min(all_y), max(all_y) if max(all_y) > min(all_y) else min(all_y) + 1

    def px(x: float) -> float:
        return PAD + (x - x0) / (x1 - x0 or 1) * (WIDTH - 2 * PAD)

    def py(y: float) -> float:
        return HEIGHT - PAD - (y - y0) / (y1 - y0) * (HEIGHT - 2 * PAD)

    def polyline(points: list[tuple[float, float]], colour: str) -> str:
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        return f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{coords}"/>'

    ticks = "".join(
        f'<text x="{PAD - 6}" y="{py(v) + 4:.1f}" text-anchor="end" font-size="11">{v:.2f}</text>'
        for v in (y0, (y0 + y1) / 2, y1)
    ) + "".join(
        f'<text x="{px(v):.1f}" y="{HEIGHT - PAD + 16}" text-anchor="middle" font-size="11">{v:g}</text>'
        for v in (x0, x1)
    )
    series, legend = "", ""
    for _, points, colour in others:
        series += polyline(points, colour) if len(points) > 1 else ""
        if len(points) <= MARKER_MAX_POINTS:
            series += "".join(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>' for x, y in points)
    if others:
        # top right: loss curves fall from the top left, so that corner is usually empty
        entries = [(label if label is not None else title, "#1f77b4")]
        entries += [(name, colour) for name, _, colour in others]
        for i, (name, colour) in enumerate(entries):
            y = PAD + 12 + 16 * i
            legend += (
                f'<line x1="{WIDTH - PAD - 24}" y1="{y - 4}" x2="{WIDTH - PAD - 6}" y2="{y - 4}" '
                f'stroke="{colour}" stroke-width="2"/>'
                f'<text x="{WIDTH - PAD - 30}" y="{y}" text-anchor="end" font-size="11">{escape(name)}</text>'
            )
    if skipped:
        legend += (
            f'<text x="{WIDTH - PAD}" y="{PAD - 8}" text-anchor="end" font-size="11">'
            f"{skipped} non-finite value{'s' if skipped > 1 else ''} (NaN/inf) not drawn</text>"
        )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif">'
        f'<rect width="100%" height="100%" fill="white"/>'
        f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>'
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="black"/>'
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="black"/>{ticks}'
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 10}" text-anchor="middle" font-size="12">{escape(x_label)}</text>'
        f'<text x="14" y="{HEIGHT / 2}" text-anchor="middle" font-size="12" '
        f'transform="rotate(-90 14 {HEIGHT / 2})">{escape(y_label)}</text>'
        f"{polyline(main, '#1f77b4')}{series}{legend}</svg>"
    )


def _diverging(ratio: float) -> str:
    """Blue below the mean, white at the mean, red at twice the mean or more."""
    low, mid, high = (59, 76, 192), (245, 245, 245), (180, 4, 38)
    ratio = max(0.0, min(ratio, 2.0))
    start, end, t = (low, mid, ratio) if ratio < 1 else (mid, high, ratio - 1)
    return "rgb({},{},{})".format(*(round(a + (b - a) * t) for a, b in zip(start, end, strict=True)))


def heatmap_svg(rows: Sequence[Sequence[float]], title: str, row_label: str, col_label: str) -> str:
    """One cell per value, coloured by its ratio to the row mean (the ratio is written in the cell)."""
    n_rows, n_cols = len(rows), len(rows[0])
    cell_w, cell_h = (WIDTH - 2 * PAD) / n_cols, (HEIGHT - 2 * PAD) / n_rows
    font = max(6, min(11, int(cell_w / 3)))
    cells = []
    for r, row in enumerate(rows):
        mean = sum(row) / len(row) or 1.0
        for c, value in enumerate(row):
            x, y = PAD + c * cell_w, PAD + r * cell_h
            cells.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{cell_w:.1f}" height="{cell_h:.1f}" '
                f'fill="{_diverging(value / mean)}" stroke="white">'
                f"<title>{escape(row_label)} {r}, {escape(col_label)} {c}: "
                f"{value:g} ({value / mean:.2f}x mean)</title></rect>"
            )
            if n_cols <= 32 and n_rows <= 32:
                cells.append(
                    f'<text x="{x + cell_w / 2:.1f}" y="{y + cell_h / 2 + font / 3:.1f}" text-anchor="middle" '
                    f'font-size="{font}">{value / mean:.2f}</text>'
                )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif">'
        f'<rect width="100%" height="100%" fill="white"/>'
        f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>'
        f'<text x="{WIDTH / 2}" y="36" text-anchor="middle" font-size="11">'
        "blue: below the layer mean, white: at the mean, red: twice the mean or more</text>"
        f"{''.join(cells)}"
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 14}" text-anchor="middle" font-size="12">'
        f"{escape(col_label)} (0..{n_cols - 1})</text>"
        f'<text x="16" y="{HEIGHT / 2}" text-anchor="middle" font-size="12" '
        f'transform="rotate(-90 16 {HEIGHT / 2})">{escape(row_label)} (0..{n_rows - 1})</text></svg>'
    )
