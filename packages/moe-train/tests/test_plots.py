import xml.etree.ElementTree as ET

from moe_train.plots import heatmap_svg, line_chart_svg

SVG = "{http://www.w3.org/2000/svg}"


def test_line_chart_has_one_point_per_value_and_is_valid_svg() -> None:
    svg = ET.fromstring(line_chart_svg([1, 2, 3, 4], [5.0, 3.0, 2.5, 2.0], "loss", "step", "nats"))
    (line,) = svg.iter(f"{SVG}polyline")
    points = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
    assert len(points) == 4
    # higher loss is drawn higher (smaller y), steps go left to right
    assert points[0][1] < points[-1][1] and points[0][0] < points[-1][0]


def test_heatmap_cell_per_value_with_relative_load_in_tooltip() -> None:
    svg = ET.fromstring(heatmap_svg([[1, 3], [2, 2]], "load", "layer", "expert"))
    cells = [r for r in svg.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert len(cells) == 4
    assert "1.50x mean" in cells[1].find(f"{SVG}title").text
    assert "1.00x mean" in cells[2].find(f"{SVG}title").text
