"""Small dependency-free SVG pictures: the loss curve and the expert load of every MoE layer."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

WIDTH, HEIGHT, PAD = 640, 360, 48


def line_chart_svg(xs: Sequence[float], ys: Sequence[float], title: str, x_label: str, y_label: str) -> str:
    x0, x1 = min(xs), max(xs) if len(xs) > 1 else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def px(x: float) -> float:
        return PAD + (x - x0) / (x1 - x0 or 1) * (WIDTH - 2 * PAD)

    def py(y: float) -> float:
        return HEIGHT - PAD - (y - y0) / (y1 - y0) * (HEIGHT - 2 * PAD)

    points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys, strict=True))
    ticks = "".join(
        f'<text x="{PAD - 6}" y="{py(v) + 4:.1f}" text-anchor="end" font-size="11">{v:.2f}</text>'
        for v in (y0, (y0 + y1) / 2, y1)
    ) + "".join(
        f'<text x="{px(v):.1f}" y="{HEIGHT - PAD + 16}" text-anchor="middle" font-size="11">{v:g}</text>'
        for v in (x0, x1)
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
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{points}"/></svg>'
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
