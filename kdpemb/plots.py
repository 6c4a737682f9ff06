"""Figures for reports: ROC curves and privacy-utility trade-offs.

Both functions write an image file and return its path. They need
matplotlib, an optional extra: `pip install "kdpemb[plots]"`. It is imported
only when a function is called, and only through matplotlib's object API
(`Figure` with the Agg canvas): no pyplot state, no window, no change to the
backend chosen elsewhere. The file format follows the suffix of `path`:
.png, .pdf or .svg.

Example:

>>> import pathlib, tempfile
>>> from kdpemb import plots
>>> with tempfile.TemporaryDirectory() as tmp:
...     path = plots.roc(([0.0, 1e-3, 0.1, 1.0], [0.0, 0.8, 0.95, 1.0]),
...                      pathlib.Path(tmp) / "roc.png")
...     path.name, path.read_bytes()[:4]
('roc.png', b'\\x89PNG')
"""

import pathlib

import numpy as np

__all__ = ["plot_privacy_utility", "roc", "spread_labels", "tar_at_far"]

_FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg"}
# A FAR that is a ratio k / n equals its decimal literal after rounding, but
# one computed otherwise may land an ulp or so above it.
_FAR_TOLERANCE = 1e-9
# TAR labels at a marked FAR: at least this far apart on the TAR axis (about
# 1.5 lines of 8-point text on the 6.4 x 4.8 inch figure), and drawn to the
# right of the mark by this factor of the (log) FAR.
_LABEL_GAP = 0.045
_LABEL_SHIFT = 1.25


def roc(curves, path, *, far_range=(1e-6, 1.0), mark_far=(1e-3,), title=None):
    """Plots TAR against FAR on a log FAR axis and writes the figure.

    One line per curve, with a legend when `curves` is a dict. The FAR axis
    spans `far_range`; a FAR of 0 (or below `far_range[0]`) cannot be drawn
    on a log axis, so such points are drawn at `far_range[0]` (the TAR at
    FAR = 0 shows up at the left edge). Points are drawn in order of FAR.
    Each FAR in `mark_far` gets a dotted vertical line and, for every curve,
    the TAR there: the largest TAR among the curve's points with FAR at most
    that value (0 when there is none: rejecting everything has FAR 0 and
    TAR 0). The annotated TAR uses the points as given, before clipping.

    Args:
        curves: tuple or dict. `(far, tar)`, two arrays of the same length
            with values in [0, 1], or `{name: (far, tar)}`. A triple
            `(far, tar, thresholds)` as from
            `kdpemb.metrics.verification_roc` is taken as `(far, tar)`.
        path: str or path-like. Where to write; .png, .pdf or .svg.
        far_range: tuple. `(low, high)` of the FAR axis, 0 < low < high <= 1.
            Defaults to `(1e-6, 1.0)`.
        mark_far: sequence of float. FARs to mark with a vertical line and
            the TAR there; those outside `far_range` are left out. Defaults
            to `(1e-3,)`.
        title: str or None. Title of the figure. Defaults to `None`.

    Returns:
        `pathlib.Path` of the written file.

    Raises:
        ValueError: a curve whose arrays differ in length, are empty, or hold
            values that are not finite or not in [0, 1]; or a bad
            `far_range`, `mark_far` or suffix of `path`.
        ImportError: matplotlib is not installed.

    Example:

    >>> import pathlib, tempfile
    >>> from kdpemb import plots
    >>> curves = {
    ...     "ε = 4": ([0.0, 1e-4, 1e-3, 1e-2, 1.0], [0.1, 0.5, 0.7, 0.9, 1.0]),
    ...     "ε = ∞": ([0.0, 1e-4, 1e-3, 1e-2, 1.0], [0.3, 0.7, 0.85, 0.95, 1.0]),
    ... }
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = plots.roc(curves, pathlib.Path(tmp) / "roc.png",
    ...                      mark_far=(1e-4, 1e-3), title="Verification")
    ...     path.stat().st_size > 0
    True
    """
    path, fmt = _check_path(path)
    low, high = _check_far_range(far_range)
    marks = _check_mark_far(mark_far)
    named = _named_pairs(curves, "curves", allow_third=True)
    checked = {}
    for name, (far, tar) in named.items():
        far, tar = _check_pair(name, far, tar, "far", "tar")
        for label, values in (("far", far), ("tar", tar)):
            if np.any((values < 0) | (values > 1)):
                raise ValueError(
                    f"Curve {_curve_label(name)}: {label} values must be in "
                    f"[0, 1], got values from {values.min():g} to "
                    f"{values.max():g}."
                )
        checked[name] = (far, tar)

    figure, canvas = _new_figure()
    axes = figure.add_subplot()
    colors = _colors()
    drawn_marks = [mark for mark in marks if low <= mark <= high]
    for index, (name, (far, tar)) in enumerate(checked.items()):
        color = colors[index % len(colors)]
        order = np.lexsort((tar, far))
        axes.plot(
            np.maximum(far[order], low),
            tar[order],
            color=color,
            label=name,
            linewidth=1.5,
        )
    for mark in drawn_marks:
        values = [tar_at_far(far, tar, mark) for far, tar in checked.values()]
        # One label per curve beside the mark, moved apart vertically where
        # curves pass close together, so that no two labels overlap.
        for index, (value, label_y) in enumerate(
            zip(values, spread_labels(values, _LABEL_GAP), strict=True)
        ):
            color = colors[index % len(colors)]
            axes.plot([mark], [value], marker="o", markersize=4, color=color)
            axes.annotate(
                f"{value:.3f}",
                (mark, value),
                xytext=(mark * _LABEL_SHIFT, label_y),
                textcoords="data",
                color=color,
                fontsize=8,
                verticalalignment="center",
            )
    for mark in drawn_marks:
        axes.axvline(mark, color="0.4", linestyle=":", linewidth=1)
        axes.annotate(
            f"FAR = {_short_number(mark)}",
            (mark, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-3, -4),
            textcoords="offset points",
            color="0.3",
            fontsize=8,
            rotation=90,
            horizontalalignment="right",
            verticalalignment="top",
        )
    axes.set_xscale("log")
    axes.set_xlim(low, high)
    axes.set_ylim(0.0, 1.0)
    axes.set_xlabel("false accept rate (FAR)")
    axes.set_ylabel("true accept rate (TAR)")
    axes.grid(True, which="major", alpha=0.3)
    if isinstance(curves, dict):
        axes.legend(loc="lower right")
    if title is not None:
        axes.set_title(title)
    return _save(canvas, path, fmt)


def spread_labels(values, gap, low=0.0, high=1.0):
    """Positions for labels of `values` on one axis, at least `gap` apart.

    Each label stays as close to its value as the others allow: labels keep
    the order of their values, runs of labels closer than `gap` are moved
    apart around their mean, and the whole set is kept in `[low, high]`
    (when it fits there).

    Example:

    >>> from kdpemb.plots import spread_labels
    >>> [round(y, 3) for y in spread_labels([0.50, 0.51, 0.9], gap=0.05)]
    [0.48, 0.53, 0.9]
    """
    values = np.asarray(values, dtype=float)
    order = np.argsort(values, kind="stable")
    # Clusters of consecutive labels, each centred on the mean of its values,
    # merged while two neighbours overlap (pool adjacent violators).
    clusters = []  # [sum of values, count]
    for value in values[order]:
        clusters.append([value, 1])
        while len(clusters) > 1:
            (sum_a, n_a), (sum_b, n_b) = clusters[-2], clusters[-1]
            top_of_a = sum_a / n_a + gap * (n_a - 1) / 2
            bottom_of_b = sum_b / n_b - gap * (n_b - 1) / 2
            if bottom_of_b - top_of_a >= gap:
                break
            clusters[-2:] = [[sum_a + sum_b, n_a + n_b]]
    positions = []
    for total, count in clusters:
        centre = total / count
        positions.extend(centre + gap * (np.arange(count) - (count - 1) / 2))
    positions = np.asarray(positions)
    if len(positions) and positions[-1] - positions[0] <= high - low:
        positions += max(low - positions[0], 0.0) - max(positions[-1] - high, 0.0)
    placed = np.empty_like(positions)
    placed[order] = positions
    return [float(y) for y in placed]


def plot_privacy_utility(
    results,
    path,
    *,
    utility_name="Recall@FAR=1e-3",
    epsilon_log=True,
    title=None,
):
    """Plots utility against ε, one line per method, and writes the figure.

    Each method is a line with markers over its finite ε, in order of ε.
    A point with ε = ∞ (the non-private baseline) has no place on the ε axis:
    it is drawn as a dashed horizontal line at its utility, labelled with
    the method's name (with " (ε = ∞)" added when the method also has
    finite points). A method may consist of such a point alone.

    Args:
        results: tuple or dict. `(epsilons, utilities)`, two arrays of the
            same length, or `{name: (epsilons, utilities)}`. Each ε is
            positive (or 0 on a linear axis) or `inf`; utilities are finite.
        path: str or path-like. Where to write; .png, .pdf or .svg.
        utility_name: str. Label of the utility axis. Defaults to
            `"Recall@FAR=1e-3"`.
        epsilon_log: bool. Whether the ε axis is logarithmic. Defaults to
            `True`.
        title: str or None. Title of the figure. Defaults to `None`.

    Returns:
        `pathlib.Path` of the written file.

    Raises:
        ValueError: arrays that differ in length or are empty, an ε that is
            NaN, negative (or 0 on a log axis), a utility that is not
            finite, or a bad suffix of `path`.
        ImportError: matplotlib is not installed.

    Example:

    >>> import math, pathlib, tempfile
    >>> from kdpemb import plots
    >>> results = {
    ...     "DP-SGD": ([1.0, 2.0, 4.0, 8.0], [0.41, 0.55, 0.66, 0.72]),
    ...     "non-private": ([math.inf], [0.83]),
    ... }
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = plots.plot_privacy_utility(
    ...         results, pathlib.Path(tmp) / "tradeoff.png")
    ...     path.suffix, path.stat().st_size > 0
    ('.png', True)
    """
    path, fmt = _check_path(path)
    named = _named_pairs(results, "results")
    checked = {}
    for name, (epsilons, utilities) in named.items():
        epsilons, utilities = _check_pair(
            name, epsilons, utilities, "epsilons", "utilities", allow_inf_x=True
        )
        if np.any(epsilons <= 0 if epsilon_log else epsilons < 0):
            raise ValueError(
                f"Curve {_curve_label(name)}: epsilons must be "
                f"{'positive on a log axis' if epsilon_log else 'non-negative'}"
                f", got {epsilons.min():g}."
            )
        checked[name] = (epsilons, utilities)

    figure, canvas = _new_figure()
    axes = figure.add_subplot()
    colors = _colors()
    reference = axes.get_yaxis_transform()  # x in axes fraction, y in data.
    any_finite = False
    for index, (name, (epsilons, utilities)) in enumerate(checked.items()):
        color = colors[index % len(colors)]
        finite = np.isfinite(epsilons)
        if finite.any():
            any_finite = True
            order = np.argsort(epsilons[finite], kind="stable")
            axes.plot(
                epsilons[finite][order],
                utilities[finite][order],
                marker="o",
                color=color,
                label=name,
            )
        label = _infinity_label(name, with_finite=finite.any())
        for number, utility in enumerate(utilities[~finite]):
            axes.axhline(
                utility,
                color=color,
                linestyle="--",
                linewidth=1.2,
                label=label if number == 0 else None,
            )
            if number == 0:
                axes.text(
                    0.01,
                    utility,
                    label,
                    transform=reference,
                    color=color,
                    fontsize=8,
                    verticalalignment="bottom",
                )
    if epsilon_log:
        axes.set_xscale("log")
        _plain_log_ticks(axes.xaxis)
    if not any_finite:
        axes.set_xlim(*((0.1, 10.0) if epsilon_log else (0.0, 10.0)))
    every = np.concatenate([utilities for _, utilities in checked.values()])
    if every.min() >= 0 and every.max() <= 1:
        axes.set_ylim(0.0, 1.0)
    axes.set_xlabel("privacy budget ε")
    axes.set_ylabel(utility_name)
    axes.grid(True, which="major", alpha=0.3)
    if isinstance(results, dict):
        axes.legend(loc="lower right")
    if title is not None:
        axes.set_title(title)
    return _save(canvas, path, fmt)


def tar_at_far(far, tar, target_far):
    """The best TAR among points of a ROC curve with FAR at most `target_far`.

    Returns the largest `tar[i]` over the points with `far[i] <= target_far`
    (allowing a relative rounding error of 1e-9 in `far`), or 0.0 when no
    point qualifies: the threshold that rejects everything has FAR 0 and
    TAR 0. The points may come in any order.

    Args:
        far: array-like. False accept rates of the curve's points.
        tar: array-like. True accept rates, the same length as `far`.
        target_far: float. The FAR that may not be exceeded.

    Returns:
        float.

    Example:

    >>> from kdpemb.plots import tar_at_far
    >>> far, tar = [0.0, 1e-3, 0.01, 1.0], [0.2, 0.6, 0.9, 1.0]
    >>> tar_at_far(far, tar, 1e-3), tar_at_far(far, tar, 5e-3)
    (0.6, 0.6)
    >>> tar_at_far([0.01, 0.1], [0.9, 1.0], 1e-3)
    0.0
    """
    far = np.asarray(far, dtype=float).ravel()
    tar = np.asarray(tar, dtype=float).ravel()
    if far.shape != tar.shape:
        raise ValueError(
            f"far and tar must have the same length, got {far.size} and {tar.size}."
        )
    within = far <= target_far * (1 + _FAR_TOLERANCE)
    return float(tar[within].max()) if within.any() else 0.0


# Helpers.


def _new_figure():
    try:
        import matplotlib  # noqa: F401  (fails fast when it is missing)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            'kdpemb.plots needs matplotlib: pip install "kdpemb[plots]" '
            "(or pip install matplotlib)."
        ) from error
    figure = Figure(figsize=(6.4, 4.8), dpi=100, layout="constrained")
    return figure, FigureCanvasAgg(figure)


def _plain_log_ticks(axis):
    """Tick labels 0.5, 1, 2, 10 rather than 5×10⁻¹, 10⁰, 2×10⁰, 10¹."""
    from matplotlib import ticker

    class MinorLabels(ticker.Formatter):
        # Label a few minor ticks only when the axis spans few decades.
        def __call__(self, x, pos=None):
            low, high = self.axis.get_view_interval()
            if x <= 0 or low <= 0:
                return ""
            decades = np.log10(high / low)
            mantissa = round(x / 10 ** np.floor(np.log10(x)), 6)
            if decades < 1:
                keep = (2, 3, 4, 5, 6, 7, 8, 9)
            elif decades < 2.5:
                keep = (2, 5)
            else:
                keep = ()
            return _short_number(x) if mantissa in keep else ""

    axis.set_major_formatter(ticker.FuncFormatter(lambda x, _: _short_number(x)))
    axis.set_minor_formatter(MinorLabels())


def _short_number(x):
    """1e-4 rather than 0.0001, 0.01 and 2 as they are."""
    text = f"{x:.3g}"
    if "e" in text or x >= 0.01:
        return text.replace("e-0", "e-").replace("e+0", "e+")
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _colors():
    import matplotlib

    colors = matplotlib.rcParams["axes.prop_cycle"].by_key().get("color")
    return colors or ["C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7"]


def _save(canvas, path, fmt):
    canvas.print_figure(path, format=fmt)
    return path


def _check_path(path):
    path = pathlib.Path(path)
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"path must end in .png, .pdf or .svg, got {str(path)!r}.")
    return path, fmt


def _check_far_range(far_range):
    try:
        low, high = (float(value) for value in far_range)
    except (TypeError, ValueError):
        raise ValueError(
            f"far_range must be a pair (low, high), got {far_range!r}."
        ) from None
    if not 0 < low < high <= 1:
        raise ValueError(
            f"far_range must satisfy 0 < low < high <= 1, got {far_range!r}."
        )
    return low, high


def _check_mark_far(mark_far):
    if mark_far is None:
        return ()
    if isinstance(mark_far, (int, float)):
        mark_far = (mark_far,)
    marks = tuple(float(value) for value in mark_far)
    for mark in marks:
        if not 0 < mark <= 1:
            raise ValueError(f"mark_far values must be in (0, 1], got {mark:g}.")
    return marks


def _named_pairs(data, argument, allow_third=False):
    """`{name: (x, y)}` from a dict or from a single pair (named None).

    With `allow_third`, a triple `(x, y, extra)` counts as `(x, y)`.
    """
    if isinstance(data, dict):
        if not data:
            raise ValueError(f"{argument} is an empty dict: nothing to plot.")
        pairs = data
    else:
        pairs = {None: data}
    named = {}
    for name, pair in pairs.items():
        name = None if name is None else str(name)
        try:
            items = tuple(pair)
        except TypeError:
            items = ()
        if len(items) == 3 and allow_third:
            items = items[:2]
        if len(items) != 2:
            expected = "(x, y) or (x, y, thresholds)" if allow_third else "(x, y)"
            raise ValueError(
                f"Curve {_curve_label(name)}: expected a pair of arrays "
                f"{expected}, got {type(pair).__name__} of length {len(items)}."
            )
        named[name] = items
    return named


def _check_pair(name, x, y, x_name, y_name, allow_inf_x=False):
    arrays = []
    for label, values in ((x_name, x), (y_name, y)):
        try:
            array = np.asarray(values, dtype=float)
        except (TypeError, ValueError):
            raise ValueError(
                f"Curve {_curve_label(name)}: {label} must be numbers."
            ) from None
        if array.ndim != 1:
            raise ValueError(
                f"Curve {_curve_label(name)}: {label} must be one-dimensional, "
                f"got shape {array.shape}."
            )
        arrays.append(array)
    x, y = arrays
    if x.size != y.size:
        raise ValueError(
            f"Curve {_curve_label(name)}: {x_name} and {y_name} must have the "
            f"same length, got {x.size} and {y.size}."
        )
    if x.size == 0:
        raise ValueError(f"Curve {_curve_label(name)}: no points.")
    bad_x = np.isnan(x) | (np.isneginf(x) if allow_inf_x else ~np.isfinite(x))
    if bad_x.any():
        allowed = "NaN or -inf" if allow_inf_x else "NaN or infinite"
        raise ValueError(f"Curve {_curve_label(name)}: {x_name} must not be {allowed}.")
    if not np.isfinite(y).all():
        raise ValueError(f"Curve {_curve_label(name)}: {y_name} must be finite.")
    return x, y


def _infinity_label(name, with_finite):
    if name is None:
        return "ε = ∞"
    return f"{name} (ε = ∞)" if with_finite else name


def _curve_label(name):
    return "(unnamed)" if name is None else repr(name)
