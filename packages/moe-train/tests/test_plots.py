import xml.etree.ElementTree as ET

from moe_train.plots import HEIGHT, PAD, WIDTH, heatmap_svg, line_chart_svg

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


def _plot_area_points(svg: ET.Element) -> list[tuple[float, float]]:
    lines = [tuple(map(float, p.split(","))) for line in svg.iter(f"{SVG}polyline") for p in line.get("points").split()]
    dots = [(float(c.get("cx")), float(c.get("cy"))) for c in svg.iter(f"{SVG}circle")]
    return lines + dots


def _inside_plot_area(point: tuple[float, float]) -> bool:
    return PAD <= point[0] <= WIDTH - PAD and PAD <= point[1] <= HEIGHT - PAD


def test_line_chart_extra_series_shares_the_axes_and_has_a_legend() -> None:
    steps, loss = [1, 2, 3, 4, 5, 6], [6.0, 5.0, 4.0, 3.5, 3.2, 3.0]
    # validation every third step, with a value above every training loss: the y range must grow to hold it
    svg = ET.fromstring(
        line_chart_svg(steps, loss, "loss", "step", "nats", extra=[("validation", [3, 6], [7.0, 3.4])], label="train")
    )
    main, val = list(svg.iter(f"{SVG}polyline"))
    assert main.get("stroke") != val.get("stroke")
    val_points = [tuple(map(float, p.split(","))) for p in val.get("points").split()]
    dots = [(float(c.get("cx")), float(c.get("cy"))) for c in svg.iter(f"{SVG}circle")]
    assert dots == val_points and len(dots) == 2  # a sparse series gets a dot per value
    assert all(map(_inside_plot_area, _plot_area_points(svg)))
    # 7.0 is the top of the y range; step 3 of 1..6 is 2/5 of the way along x
    assert val_points[0] == (PAD + 0.4 * (WIDTH - 2 * PAD), PAD)
    texts = [t.text for t in svg.iter(f"{SVG}text")]
    assert "validation" in texts and "train" in texts and "7.00" in texts


def test_line_chart_skips_non_finite_values_and_says_so() -> None:
    nan, inf = float("nan"), float("inf")
    svg = ET.fromstring(
        line_chart_svg([1, 2, 3, 4], [5.0, nan, 3.0, inf], "loss", "step", "nats", extra=[("val", [2], [nan])])
    )
    main, *_ = svg.iter(f"{SVG}polyline")
    assert len(main.get("points").split()) == 2
    assert all(map(_inside_plot_area, _plot_area_points(svg)))  # a nan coordinate would compare False
    assert "3 non-finite values (NaN/inf) not drawn" in [t.text for t in svg.iter(f"{SVG}text")]


def test_line_chart_of_only_non_finite_values_is_still_valid_svg() -> None:
    svg = ET.fromstring(line_chart_svg([1, 2], [float("nan")] * 2, "loss", "step", "nats"))
    (main,) = svg.iter(f"{SVG}polyline")
    assert main.get("points") == ""
