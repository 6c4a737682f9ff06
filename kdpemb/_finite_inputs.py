"""The one rule for NaN or infinite inputs: refused before any use.

Every trainer (`DPModel`, `LastLayerDPClassifier`, `VirtualClients` for
`FedEmbModel`, `CentralizedBaseline`), `kdpemb.features.extract` and
`write_user_shards` refuse non-finite inputs with a
`kdpemb.errors.NonFiniteInputError` naming the first bad row. They are
never dropped: dropping would silently change the data the privacy
guarantee is about (the user's dataset, and its unit's examples). Arrays
are scanned whole before training (`check_array`, in blocks of bounded
memory); streams batch by batch as they are read, before the batch is
used (`check_rows`). Where the data is cast before use (float64 to the
float32 a model computes in), `as_dtype` names that dtype, and values
too large for it (e.g. 1e39, infinite in float32) are refused as well.
Only float data is checked: integers (labels, ids, uint8 pixels) cannot
be non-finite. What is checked: `fit`'s `x`, `y` (and `sample_weight`
for `CentralizedBaseline`) and `validation_data` given as arrays, also
inside a dict, list or tuple (`check_structure`, `check_validation_data`);
a dataset or generator as validation data is Keras' to read, unchecked.
NumPy on the host, never inside a compiled step. Imports only
`kdpemb.errors`.

Example:

>>> import numpy as np
>>> x = np.zeros((5, 2), np.float32)
>>> x[3, 1] = np.nan
>>> try:
...     check_array(x, "x", what="inputs")
... except NonFiniteInputError as error:
...     print(error.row, str(error)[:32])
3 x[3] holds NaN or infinite input
"""

import math

import numpy as np

from kdpemb.errors import NonFiniteInputError

# Bytes of one block `check_array` reads at once (a bool per element too,
# and a copy of the block where `as_dtype` is narrower than the data).
BLOCK_BYTES = 2**26
_MAX_BLOCK_ROWS = 2**16
# Names `check_validation_data` gives the parts of `(x_val, y_val, weights)`.
_VALIDATION_PARTS = (
    ("x_val", "inputs"),
    ("y_val", "targets"),
    ("val_sample_weight", "weights"),
)


def largest_finite(dtype, as_dtype):
    """The largest magnitude that `dtype` data keeps finite once cast to
    `as_dtype`, or None where that cast cannot overflow (or `as_dtype` is
    None, or a dtype NumPy does not know).

    Example:

    >>> largest_finite(np.float64, "float32"), largest_finite(np.float32, "float32")
    (3.4028234663852886e+38, None)
    """
    if as_dtype is None:
        return None
    try:
        largest = float(np.finfo(np.dtype(as_dtype)).max)
    except (TypeError, ValueError):
        return None
    return largest if largest < float(np.finfo(dtype).max) else None


def check_rows(
    rows,
    name,
    *,
    first=0,
    what="values",
    where="",
    action="training",
    as_dtype=None,
):
    """Refuses NaN or infinite values in `rows`, rows `first...` of `name`.

    Args:
        rows: array-like `(n, ...)`: a block of rows (a batch as read).
        name: str. The data in the message, e.g. `"images"`.
        first: int. The row of `name` that `rows` starts at.
        what: str. What a row holds, e.g. `"pixels"`.
        where: str. Where the block came from, e.g. `"element 3 of the
            tf.data.Dataset"`, or "".
        action: str. What the user must clean the data before.
        as_dtype: None, or the dtype the rows are cast to before use
            (e.g. "float32"): values beyond its range are refused too.

    Raises:
        NonFiniteInputError: naming the first bad row; its `row` is that
            row of `name`.

    Example:

    >>> block = np.ones((3, 2))
    >>> block[2, 0] = -np.inf
    >>> try:
    ...     check_rows(block, "features", first=10, where="batch 4")
    ... except NonFiniteInputError as error:
    ...     print(str(error)[:57])
    features[12] (in batch 4) holds NaN or infinite values; 1
    """
    block = np.asarray(rows)
    if block.dtype.kind not in "fc" or not block.size:
        return
    if block.ndim == 0:
        block = block.reshape(1)
    flat = block.reshape(len(block), -1)
    largest = largest_finite(block.dtype, as_dtype)
    # NaN fails `<=` too; the cast would make what exceeds `largest` infinite.
    ok = np.isfinite(flat) if largest is None else np.abs(flat) <= largest
    bad = ~ok.all(axis=1)
    if not bad.any():
        return
    row = first + int(np.flatnonzero(bad)[0])
    inside = f" (in {where})" if where else ""
    if largest is None:
        beyond, keep = "", f"np.isfinite({name})"
    else:  # Also infinite once cast to `as_dtype`, as the model computes.
        target = np.dtype(as_dtype).name
        beyond = f", or {what} beyond ±{largest:.4g} (infinite in {target})"
        keep = f"(np.abs({name}) <= np.finfo(np.{target}).max)"
    raise NonFiniteInputError(
        f"{name}[{row}]{inside} holds NaN or infinite {what}{beyond}; "
        f"{int(bad.sum())} of the rows {first}..{first + len(block) - 1} do. "
        "kdpemb refuses non-finite inputs before any use, so nothing was "
        f"trained, released or spent: clean or drop those rows before {action} "
        f"(e.g. keep the rows where {keep}.reshape(len({name}), -1).all(1)).",
        row,
    )


def check_array(
    array, name, *, what="values", where="", action="training", as_dtype=None
):
    """Refuses NaN or infinite values anywhere in `array`, read in blocks.

    `array` is a NumPy array or a lazy array-like (`shape`, `len()`,
    slicing: a memory map, a `ShardedArray`); a block holds at most
    `BLOCK_BYTES` of it, so memory does not grow with the data. Non-float
    data returns at once. `where` and `as_dtype` as for `check_rows`.

    Example:

    >>> check_array(np.arange(6).reshape(3, 2), "y")  # Integers: nothing read.
    >>> y = np.array([0.5, np.inf])
    >>> try:
    ...     check_array(y, "y", what="targets", action="fit")
    ... except NonFiniteInputError as error:
    ...     print(str(error)[:33])
    y[1] holds NaN or infinite target
    >>> try:  # 1e39 is finite in float64, infinite in float32.
    ...     check_array(np.array([[1.0], [1e39]]), "x", as_dtype="float32")
    ... except NonFiniteInputError as error:
    ...     print(error.row)
    1
    """
    first = np.asarray(array[:1])
    if first.dtype.kind not in "fc":
        return
    row_bytes = max(1, math.prod(first.shape[1:]) * first.dtype.itemsize)
    step = max(1, min(_MAX_BLOCK_ROWS, BLOCK_BYTES // row_bytes))
    for start in range(0, len(array), step):
        block = array[start : start + step]
        check_rows(
            block, name, first=start, what=what, where=where, action=action,
            as_dtype=as_dtype,
        )  # fmt: skip


def check_structure(value, name, **how):
    """`check_array` on every array in `value`: an array (or array-like
    with `shape`), a list of numbers, or a dict, list or tuple of arrays
    (each named `name[key]`). Anything else (None, a dataset, a
    generator) is passed over: it is read later by whoever reads it.
    `how`: `check_array`'s keywords.

    Example:

    >>> try:
    ...     check_structure({"a": np.ones(2), "b": [0.0, np.nan]}, "x")
    ... except NonFiniteInputError as error:
    ...     print(str(error)[:35])
    x['b'][1] holds NaN or infinite val
    """
    if isinstance(value, dict):
        for key, part in value.items():
            check_structure(part, f"{name}[{key!r}]", **how)
    elif isinstance(value, list | tuple) and all(hasattr(p, "shape") for p in value):
        for i, part in enumerate(value):
            check_structure(part, f"{name}[{i}]", **how)
    elif isinstance(value, list | tuple):
        try:
            array = np.asarray(value)
        except ValueError:  # Ragged: refused by whoever reads it.
            return
        check_structure(array, name, **how)
    elif hasattr(value, "shape") and len(value.shape) >= 1:
        check_array(value, name, **how)


def check_validation_data(data, *, action="fit", as_dtype=None):
    """Refuses non-finite arrays in Keras' `validation_data`: a tuple
    `(x_val, y_val)` or `(x_val, y_val, val_sample_weight)` of arrays (or
    dicts or lists of arrays); a NaN there gives a `val_loss` of nan. A
    dataset or generator is passed over (Keras reads it, unchecked).

    Example:

    >>> try:
    ...     check_validation_data((np.ones((2, 1)), np.array([0.0, np.inf])))
    ... except NonFiniteInputError as error:
    ...     print(str(error)[:36])
    y_val[1] holds NaN or infinite targe
    """
    if not isinstance(data, list | tuple):
        return
    for part, (name, what) in zip(data, _VALIDATION_PARTS, strict=False):
        check_structure(part, name, what=what, action=action, as_dtype=as_dtype)
