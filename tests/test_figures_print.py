"""Bar and confusion figures a paper can print: drawn at a column's width (3.4 in) and a page's (7 in), the PNG
as many pixels as those inches at the print resolution, every text inside the canvas, each value label above its
error bar and clear of the other labels. Measured on the drawn figure (each text's window extent against the
canvas, in display pixels), not on the code's own arithmetic."""

from __future__ import annotations

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text
from PIL import Image

import fedhpro.methods  # noqa: F401  (registers the methods: FedHPro is shown as the paper writes it)
from fedhpro.reports.plots import COLUMN_WIDTH, PAGE_WIDTH, PRINT_DPI, plot_bars, plot_confusion

TITLE = ("mnist, Dirichlet label skew (alpha = 0.2): test accuracy of the head, middle and tail classes (mean "
         "over seeds; bars: 95 % t-interval)")
GROUPS = {"fedavg": {"head (3 classes)": 91.2, "middle (4 classes)": 80.4, "tail (3 classes)": 47.8},
          "fedsa": {"head (3 classes)": 92.0, "middle (4 classes)": 84.1, "tail (3 classes)": 75.3},
          "fedhpro": {"head (3 classes)": 99.5, "middle (4 classes)": 82.2, "tail (3 classes)": 60.1}}
ERRORS = {"fedavg": {"head (3 classes)": 4.0, "middle (4 classes)": 6.0, "tail (3 classes)": 7.0},
          "fedsa": {"head (3 classes)": 5.0, "middle (4 classes)": 6.0, "tail (3 classes)": 7.0},
          "fedhpro": {"head (3 classes)": 9.0, "middle (4 classes)": 6.0, "tail (3 classes)": 7.0}}
CLASSES = {name: {str(c): 40 + 5.5 * c + 2 * i for c in range(10)} for i, name in enumerate(GROUPS)}
CLASS_ERRORS = {name: {str(c): 3.5 for c in range(10)} for name in GROUPS}


def drawn(figure, path):
    """The figure drawn again on an Agg canvas (its layout redone, as savefig did) and its renderer; the PNG as
    many pixels as the figure's inches at the print resolution."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    with Image.open(path) as image:
        width, height = figure.get_size_inches()
        assert image.size == (round(width * PRINT_DPI), round(height * PRINT_DPI))
    return canvas.get_renderer()


def texts_inside(figure, renderer) -> list[Text]:
    """Every text the figure draws (visible, not empty; of the tick labels those of ticks in view, the others are
    not drawn); each asserted to lie inside the canvas, and the tight box of all that is drawn too."""
    canvas = figure.bbox
    ticks, shown = set(), []
    for axes in figure.axes:
        for axis in (axes.xaxis, axes.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                ticks.update({id(tick.label1), id(tick.label2)})
                if low - 1e-9 * max(1.0, abs(high)) <= tick.get_loc() <= high + 1e-9 * max(1.0, abs(high)):
                    shown += [tick.label1, tick.label2]
    texts = [t for t in figure.findobj(Text) if id(t) not in ticks] + shown
    texts = [t for t in texts if t.get_visible() and t.get_text().strip()]
    tight = figure.get_tightbbox(renderer).transformed(figure.dpi_scale_trans)
    assert tight.x0 >= -0.5 and tight.y0 >= -0.5 and tight.x1 <= canvas.x1 + 0.5 and tight.y1 <= canvas.y1 + 0.5
    for text in texts:
        box = text.get_window_extent(renderer)
        assert box.x0 >= canvas.x0 - 0.5 and box.x1 <= canvas.x1 + 0.5, text.get_text()
        assert box.y0 >= canvas.y0 - 0.5 and box.y1 <= canvas.y1 + 0.5, text.get_text()
    return texts


def check_value_labels(figure, renderer, groups, errors) -> int:
    """Each value label's bottom at or above its bar's error-bar top (display pixels), labels apart from one
    another; returns how many labels there are."""
    count = 0
    for axis in figure.axes:
        labels = [t for t in axis.texts if t.get_text().strip()]
        boxes = [t.get_window_extent(renderer) for t in labels]
        for text, box in zip(labels, boxes):
            x, _ = text.xy
            value = float(text.get_text())
            name = next(n for n, values in groups.items() for v in values.values() if abs(v - value) < 0.05)
            spread = next(errors[name][m] for m, v in groups[name].items() if abs(v - value) < 0.05)
            top = axis.transData.transform((x, value + spread))[1]
            assert box.y0 >= top - 0.5, (text.get_text(), box.y0, top)
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), "two value labels overlap"
        count += len(labels)
    return count


@pytest.mark.slow
@pytest.mark.parametrize("width", [COLUMN_WIDTH, PAGE_WIDTH])
def test_bar_figures_fit_a_column_and_a_page(tmp_path, width):
    path = tmp_path / "groups.png"
    figure = plot_bars(GROUPS, path, errors=ERRORS, ylabel="test accuracy (%)", xlabel="class group", title=TITLE,
                       width=width)
    renderer = drawn(figure, path)
    assert figure.get_size_inches()[0] == pytest.approx(width)
    texts = [t.get_text() for t in texts_inside(figure, renderer)]
    assert {"FedAvg", "FedSA", "FedHPro"} <= set(texts)  # the legend, named as the paper writes them
    assert check_value_labels(figure, renderer, GROUPS, ERRORS) == 9  # every bar's value, at both widths
    assert (tmp_path / "groups.pdf").is_file()

    path = tmp_path / "classes.png"  # 30 bars: at a column's width too thin for upright numbers
    figure = plot_bars(CLASSES, path, errors=CLASS_ERRORS, ylabel="test accuracy (%)", xlabel="class", title=TITLE,
                       width=width)
    renderer = drawn(figure, path)
    texts_inside(figure, renderer)
    check_value_labels(figure, renderer, CLASSES, CLASS_ERRORS)

    path = tmp_path / "fairness.png"  # no error bars (a fairness figure of single runs)
    fair = {"fedavg": {"worst 10%": 60.1, "average": 80.2, "best 10%": 95.5, "std": 10.3},
            "fedhpro": {"worst 10%": 65.1, "average": 82.2, "best 10%": 94.5, "std": 8.3}}
    figure = plot_bars(fair, path, title="accuracy across clients", ylabel="test accuracy (%)", width=width)
    renderer = drawn(figure, path)
    texts_inside(figure, renderer)
    assert check_value_labels(figure, renderer, fair, {n: dict.fromkeys(v, 0.0) for n, v in fair.items()}) == 8


@pytest.mark.parametrize("width", [COLUMN_WIDTH, PAGE_WIDTH])
def test_a_confusion_figure_fits_and_shows_every_count(tmp_path, width):
    matrix = [[40 if t == p else (t + p) % 4 for p in range(10)] for t in range(10)]
    matrix[3][3] = 1234
    path = tmp_path / "confusion_fedavg.png"
    figure = plot_confusion(matrix, [str(c) for c in range(10)], path,
                            title="FedAvg: confusion matrix (summed over 3 runs)\nmnist, Dirichlet label skew "
                                  "(alpha = 0.2)", width=width)
    renderer = drawn(figure, path)
    texts_inside(figure, renderer)
    axis = figure.axes[0]
    cells = [t.get_text() for t in axis.texts]
    assert sorted(cells) == sorted(str(v) for row in matrix for v in row)  # scikit-learn's look: counts in cells
    assert axis.get_xlabel() == "predicted class" and axis.get_ylabel() == "true class"
    assert (tmp_path / "confusion_fedavg.pdf").is_file()
