import importlib.util
import math
import sys

import numpy as np
import pytest
from PIL import Image

from kdpemb import plots

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
# matplotlib is the optional extra kdpemb[plots]; validation needs none.
draws = pytest.mark.skipif(not HAS_MATPLOTLIB, reason="needs matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FAR = [0.0, 1e-5, 1e-4, 1e-3, 1e-2, 1.0]
TAR = [0.05, 0.2, 0.4, 0.6, 0.85, 1.0]


def assert_png(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG"
        width, height = image.size
        assert 400 <= width <= 2000
        assert 300 <= height <= 2000
        # Something was drawn: not a blank canvas.
        assert len(image.convert("L").getcolors(maxcolors=100_000)) > 10


# roc.


@draws
def test_roc_of_one_curve_writes_a_png(tmp_path):
    path = plots.roc((FAR, TAR), tmp_path / "roc.png")
    assert path == tmp_path / "roc.png"
    assert_png(path)


@draws
def test_roc_of_named_curves_writes_a_png(tmp_path):
    curves = {
        "ε = 1": (np.array(FAR), np.array(TAR) * 0.5),
        "ε = 8": (FAR, TAR),
        "non-private": (FAR, np.minimum(np.array(TAR) + 0.1, 1.0)),
    }
    path = plots.roc(
        curves,
        str(tmp_path / "roc.png"),
        mark_far=(1e-4, 1e-3),
        title="Verification ROC",
    )
    assert isinstance(path, type(tmp_path))
    assert_png(path)


@draws
def test_roc_accepts_a_far_of_zero_and_marks_outside_the_range(tmp_path):
    # far = 0 is drawn at the lower end of far_range; a mark outside the
    # range is left out.
    path = plots.roc(
        ([0.0, 0.0, 0.5, 1.0], [0.0, 0.3, 0.9, 1.0]),
        tmp_path / "roc.png",
        far_range=(1e-3, 1.0),
        mark_far=(1e-5, 0.5),
    )
    assert_png(path)


@draws
def test_roc_draws_clipped_points_at_the_lower_end(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    drawn = []
    plot = Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append([np.asarray(arg, dtype=float) for arg in args[:2]])
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    plots.roc(
        ([1e-2, 0.0, 1e-9], [0.9, 0.1, 0.3]),
        tmp_path / "roc.png",
        far_range=(1e-6, 1.0),
        mark_far=(),
    )
    far, tar = drawn[0]
    np.testing.assert_array_equal(far, [1e-6, 1e-6, 1e-2])
    np.testing.assert_array_equal(tar, [0.1, 0.3, 0.9])


@draws
def test_roc_takes_far_tar_thresholds_triples(tmp_path):
    # As returned by kdpemb.metrics.verification_roc; thresholds are ignored.
    triple = (np.array(FAR), np.array(TAR), np.linspace(1, -1, len(FAR)))
    assert_png(plots.roc(triple, tmp_path / "one.png"))
    assert_png(plots.roc({"a": triple, "b": (FAR, TAR)}, tmp_path / "two.png"))
    with pytest.raises(ValueError, match="pair of arrays"):
        plots.plot_privacy_utility(([1.0], [0.5], [0.0]), tmp_path / "pu.png")


@draws
def test_pdf_and_svg_follow_the_suffix(tmp_path):
    assert plots.roc((FAR, TAR), tmp_path / "a.pdf").read_bytes()[:5] == b"%PDF-"
    text = plots.roc((FAR, TAR), tmp_path / "a.svg").read_text()
    assert "<svg" in text


def test_tar_at_far_against_hand_computed_values():
    far = [0.0, 1e-4, 1e-3, 1e-2, 1.0]
    tar = [0.1, 0.5, 0.7, 0.9, 1.0]
    assert plots.tar_at_far(far, tar, 1e-3) == 0.7
    assert plots.tar_at_far(far, tar, 5e-3) == 0.7
    assert plots.tar_at_far(far, tar, 1e-2) == 0.9
    assert plots.tar_at_far(far, tar, 1.0) == 1.0
    assert plots.tar_at_far(far, tar, 0.0) == 0.1
    # The largest TAR among the points allowed, in any order.
    assert plots.tar_at_far([1e-3, 0.0, 1e-3, 0.5], [0.4, 0.2, 0.6, 1.0], 1e-3) == 0.6
    # No point allowed: rejecting everything has TAR 0.
    assert plots.tar_at_far([0.01, 0.1], [0.8, 0.9], 1e-3) == 0.0
    # A FAR computed as 3 / 3000 or with a rounding error still counts.
    assert plots.tar_at_far([3 / 3000, 0.1], [0.6, 0.9], 1e-3) == 0.6
    assert plots.tar_at_far([1e-3 * (1 + 1e-12)], [0.6], 1e-3) == 0.6
    assert plots.tar_at_far([1.1e-3], [0.6], 1e-3) == 0.0
    with pytest.raises(ValueError, match="same length"):
        plots.tar_at_far([0.1, 0.2], [0.5], 0.1)


@pytest.mark.parametrize(
    ("curves", "match"),
    [
        (([0.1, 0.2], [0.5]), r"\(unnamed\).*same length"),
        ({"model A": ([0.1, 0.2], [0.5])}, "'model A'.*same length"),
        ({"b": ([0.1, np.nan], [0.5, 0.6])}, "'b'.*far must not be NaN"),
        ({"c": ([0.1, 0.2], [0.5, np.inf])}, "'c'.*tar must be finite"),
        ({"d": ([0.1, 1.5], [0.5, 0.6])}, r"'d'.*far values must be in \[0, 1\]"),
        ({"e": ([0.1, 0.2], [-0.1, 0.6])}, r"'e'.*tar values must be in \[0, 1\]"),
        ({"f": ([], [])}, "'f'.*no points"),
        ({"g": ([[0.1]], [[0.5]])}, "'g'.*one-dimensional"),
        ({"h": (["x", "y"], [0.5, 0.6])}, "'h'.*far must be numbers"),
        ({"i": ([0.1], [0.5], [1.0], [2.0])}, "'i'.*pair of arrays"),
        ({"j": 0.5}, "'j'.*pair of arrays"),
        ({}, "empty"),
    ],
)
def test_roc_validation_names_the_curve(tmp_path, curves, match):
    with pytest.raises(ValueError, match=match):
        plots.roc(curves, tmp_path / "roc.png")
    assert not (tmp_path / "roc.png").exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"far_range": (0.0, 1.0)}, "far_range"),
        ({"far_range": (1e-3, 1e-4)}, "far_range"),
        ({"far_range": (1e-3,)}, "far_range"),
        ({"mark_far": (0.0,)}, "mark_far"),
        ({"mark_far": (2.0,)}, "mark_far"),
    ],
)
def test_roc_validates_its_options(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plots.roc((FAR, TAR), tmp_path / "roc.png", **kwargs)


def test_an_unknown_suffix_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\.png"):
        plots.roc((FAR, TAR), tmp_path / "roc.jpeg")
    with pytest.raises(ValueError, match=r"\.png"):
        plots.plot_privacy_utility(([1.0], [0.5]), tmp_path / "plot")


# plot_privacy_utility.


@draws
def test_privacy_utility_of_one_method_writes_a_png(tmp_path):
    path = plots.plot_privacy_utility(
        ([8.0, 1.0, 2.0, 4.0], [0.7, 0.4, 0.5, 0.6]), tmp_path / "pu.png"
    )
    assert path == tmp_path / "pu.png"
    assert_png(path)


@draws
def test_privacy_utility_of_named_methods_writes_a_png(tmp_path):
    results = {
        "DP-SGD": ([1, 2, 4, 8, math.inf], [0.4, 0.5, 0.6, 0.7, 0.82]),
        "DP-FedAvg": (np.array([0.5, 2.0, 16.0]), np.array([0.3, 0.55, 0.75])),
        "non-private": ([math.inf], [0.85]),
    }
    path = plots.plot_privacy_utility(
        results,
        tmp_path / "pu.png",
        utility_name="TAR@FAR=1e-4",
        title="Privacy-utility",
    )
    assert_png(path)


@draws
@pytest.mark.parametrize("epsilon_log", [True, False])
def test_only_a_non_private_baseline_or_a_linear_axis(tmp_path, epsilon_log):
    path = plots.plot_privacy_utility(
        {"non-private": ([math.inf], [0.9])},
        tmp_path / "pu.png",
        epsilon_log=epsilon_log,
    )
    assert_png(path)
    path = plots.plot_privacy_utility(
        ([0.0, 1.0, math.inf], [12.0, 40.0, 80.0])
        if not epsilon_log
        else ([0.5, 1.0, math.inf], [12.0, 40.0, 80.0]),
        tmp_path / "pu2.png",
        utility_name="accuracy (%)",
        epsilon_log=epsilon_log,
    )
    assert_png(path)


@draws
def test_infinite_epsilon_is_a_dashed_line_labelled_with_the_name(
    tmp_path, monkeypatch
):
    from matplotlib.axes import Axes

    lines = []
    axhline = Axes.axhline

    def spy(self, y, *args, **kwargs):
        lines.append((y, kwargs.get("linestyle"), kwargs.get("label")))
        return axhline(self, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "axhline", spy)
    plots.plot_privacy_utility(
        {"DP-SGD": ([1.0, math.inf], [0.4, 0.8]), "baseline": ([math.inf], [0.9])},
        tmp_path / "pu.png",
    )
    assert lines == [(0.8, "--", "DP-SGD (ε = ∞)"), (0.9, "--", "baseline")]


@pytest.mark.parametrize(
    ("results", "kwargs", "match"),
    [
        ({"a": ([1.0, 2.0], [0.5])}, {}, "'a'.*same length"),
        ({"b": ([1.0, np.nan], [0.5, 0.6])}, {}, "'b'.*epsilons must not be NaN"),
        ({"c": ([1.0, -math.inf], [0.5, 0.6])}, {}, "'c'.*epsilons must not"),
        ({"d": ([1.0, 2.0], [0.5, np.nan])}, {}, "'d'.*utilities must be finite"),
        ({"e": ([0.0, 2.0], [0.5, 0.6])}, {}, "'e'.*positive on a log axis"),
        (
            {"f": ([-1.0, 2.0], [0.5, 0.6])},
            {"epsilon_log": False},
            "'f'.*non-negative",
        ),
        (([1.0], [[0.5]]), {}, r"\(unnamed\).*one-dimensional"),
        ({}, {}, "empty"),
    ],
)
def test_privacy_utility_validation_names_the_curve(tmp_path, results, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plots.plot_privacy_utility(results, tmp_path / "pu.png", **kwargs)


# Without matplotlib.


def test_missing_matplotlib_gives_a_helpful_import_error(tmp_path, monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r'pip install "kdpemb\[plots\]"'):
        plots.roc((FAR, TAR), tmp_path / "roc.png")
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plots.plot_privacy_utility(([1.0], [0.5]), tmp_path / "pu.png")
    assert not (tmp_path / "roc.png").exists()


def test_missing_matplotlib_alone_is_enough(tmp_path, monkeypatch):
    # Submodules already imported do not hide that matplotlib itself is gone.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"kdpemb\.plots needs matplotlib"):
        plots.roc((FAR, TAR), tmp_path / "roc.png")


def test_importing_the_module_does_not_import_matplotlib():
    import subprocess

    code = (
        "import sys, kdpemb.plots; "
        "print(any(m.split('.')[0] == 'matplotlib' for m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


# Labels of the TAR at a marked FAR.


@pytest.mark.parametrize(
    "values",
    [[0.5, 0.51, 0.9], [0.2, 0.2, 0.2], [0.99, 0.995], [0.0, 0.01, 0.02, 0.5], [0.3]],
)
def test_spread_labels_keeps_order_gap_and_range(values):
    gap = 0.05
    placed = np.array(plots.spread_labels(values, gap))
    order = np.argsort(values, kind="stable")
    steps = np.diff(placed[order])
    assert np.all(steps >= gap - 1e-12)
    assert placed.min() >= -1e-12 and placed.max() <= 1 + 1e-12
    # Labels move only as far as they must: the most any label moves is at
    # most the gap times the number of labels.
    assert np.max(np.abs(placed - values)) <= gap * len(values)


def test_spread_labels_leaves_separate_labels_where_they_are():
    assert plots.spread_labels([0.1, 0.6, 0.3], 0.05) == [0.1, 0.6, 0.3]


@draws
def test_roc_labels_of_close_curves_do_not_overlap(tmp_path, monkeypatch):
    # The main job's curves often cross FAR = 1e-3 within 0.01 of each
    # other; their labels used to be drawn on top of each other.
    from matplotlib.axes import Axes

    placed = []
    annotate = Axes.annotate

    def spy(self, text, xy, *args, **kwargs):
        if not text.startswith("FAR"):
            placed.append((float(xy[0]), kwargs["xytext"][1]))
        return annotate(self, text, xy, *args, **kwargs)

    monkeypatch.setattr(Axes, "annotate", spy)
    curves = {
        name: (FAR, [t + shift for t in TAR[:-1]] + [1.0])
        for name, shift in (("a", 0.0), ("b", 0.005), ("c", 0.01))
    }
    plots.roc(curves, tmp_path / "roc.png", mark_far=(1e-3, 1e-2))
    for mark in (1e-3, 1e-2):
        heights = sorted(y for x, y in placed if x == mark)
        assert len(heights) == 3
        assert np.min(np.diff(heights)) >= 0.04
