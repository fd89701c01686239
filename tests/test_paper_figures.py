"""Figures and tables a paper takes: a PDF beside every PNG/SVG (LaTeX), the same bytes for the same figure, and
counts printed as integers.

References: the PDF's own header and matplotlib's output twice; hand-written expected cells.
"""

from __future__ import annotations

from fedhpro.reports.plots import plot_curves
from fedhpro.reports.tables import format_number, markdown_table


def test_every_figure_gets_a_pdf_with_the_same_bytes_each_time(tmp_path):
    for name in ("a", "b"):
        plot_curves({"FedAvg": ([1, 2, 3], [10.0, 20.0, 30.0])}, tmp_path / name / "curve.png", ylabel="accuracy (%)")
    first, second = (tmp_path / "a" / "curve.pdf").read_bytes(), (tmp_path / "b" / "curve.pdf").read_bytes()
    assert first.startswith(b"%PDF-") and first.rstrip().endswith(b"%%EOF")
    assert first == second  # no creation date: a figure rebuilt from the same runs is the same file
    assert b"CreationDate" not in first


def test_counts_print_as_integers_and_accuracies_keep_their_decimals():
    assert format_number(317928.0) == "317928"
    assert format_number(-2048.0) == "-2048"
    assert format_number(90.0) == "90.00" and format_number(99.5) == "99.50" and format_number(1234.5) == "1234.50"
    assert format_number(float("nan")) == "–" and format_number(None) == "–" and format_number(12) == "12"
    table = markdown_table(["method", "bytes up", "AVG"], [["fedavg", 317928.0, 88.0]])
    assert "| fedavg | 317928 | 88.00 |" in table


def test_a_single_domain_run_draws_one_curve_named_by_its_domain(tmp_path):
    from fedhpro.reports.plots import plot_run_accuracy

    one = [{"round": r, "accuracy": {"mnist": 50.0 + r, "AVG": 50.0 + r}} for r in range(3)]
    figure = plot_run_accuracy(one, tmp_path / "one.png")
    assert [line.get_label() for line in figure.axes[0].get_lines()] == ["mnist"]  # no AVG hiding it
    two = [{"round": r, "accuracy": {"mnist": 50.0, "syn": 60.0, "AVG": 55.0}} for r in range(3)]
    figure = plot_run_accuracy(two, tmp_path / "two.png")
    assert [line.get_label() for line in figure.axes[0].get_lines()] == ["mnist", "syn", "AVG"]


def test_the_reports_title_says_avg_over_domains_only_with_several():
    from types import SimpleNamespace

    from fedhpro.reports.runs import avg_title

    one = SimpleNamespace(evaluated=[{"accuracy": {"mnist": 90.0, "AVG": 90.0}}])
    two = SimpleNamespace(evaluated=[{"accuracy": {"mnist": 90.0, "syn": 80.0, "AVG": 85.0}}])
    assert avg_title([one, one]) == "test accuracy (mnist)"
    assert avg_title([two]) == "test accuracy (AVG over domains)"


def test_a_bar_figure_of_62_classes_fits_a_page_with_labelled_axes(tmp_path):
    from PIL import Image

    import fedhpro.methods  # noqa: F401  (the methods' names as the paper writes them)
    from fedhpro.reports.plots import PAGE_WIDTH, PRINT_DPI, plot_bars

    classes = [f"c{k}" for k in range(62)]
    groups = {name: {c: float(k % 100) for k, c in enumerate(classes)} for name in ("fedavg", "fedhpro")}
    figure = plot_bars(groups, tmp_path / "per_class.png", ylabel="test accuracy (%)", xlabel="class")
    width, height = figure.get_size_inches()
    assert width <= PAGE_WIDTH and height <= 9.5  # was 31 x 4 in
    assert all(axis.get_xlabel() == "class" and axis.get_ylabel() for axis in figure.axes)
    shown = [tick.get_text() for axis in figure.axes for tick in axis.get_xticklabels()]
    assert shown == classes  # every class, in order, across the rows
    assert [t.get_text() for t in figure.legends[0].get_texts()] == ["FedAvg", "FedHPro"]  # once, not per row
    assert figure.axes[0].get_ylim() == figure.axes[1].get_ylim()  # rows compared on one scale
    with Image.open(tmp_path / "per_class.png") as image:
        assert image.size[0] <= PAGE_WIDTH * PRINT_DPI + 1
    small = plot_bars({"fedavg": {"head": 90.0, "tail": 20.0}}, tmp_path / "groups.png", xlabel="class group")
    assert small.get_size_inches()[0] >= 3.4 and len(small.axes) == 1
