"""One way to read images, with labels and user ids, from what users pass.

`open_input(data, fields)` tells once what `data` is and returns an
`Input` whose `batches()` yields the images and the other fields in order,
batch by batch, and whose `arrays()` gives them whole. `data` may be:

- a NumPy array `(N, ...)` of images, a list of images, or a lazy
  array-like with `shape`, `dtype`, `len()` and slicing (such as
  `SyntheticImages`), cut into batches of `batch_size`;
- an object with `.images` (a `kdpemb.datasets.UserImages`): its images,
  and its `labels` and `user_ids` where the caller requires them;
- a tuple `(images, labels, ...)` or a dict `{"images": ..., "labels": ...}`
  of such arrays;
- a `tf.data.Dataset` or a `keras.utils.PyDataset` yielding elements of
  the same structures (usually batches), read in order, once per
  `batches()`.

`kdpemb.features.extract`, the `kdpemb.callbacks.RecallAtFAR` callback and
`kdpemb.data.VirtualClients` read their data through it. Telling a dataset
apart imports neither TensorFlow nor Keras: a `tf.data.Dataset` or a
`PyDataset` can only exist once its library is loaded.
"""

import sys
from typing import NamedTuple

import numpy as np

from kdpemb import _validation as validation

FIELDS = ("images", "labels", "user_ids")


class Batch(NamedTuple):
    """Images and the other fields (None where absent); `where` names the rows."""

    images: object
    labels: object = None
    user_ids: object = None
    where: str = "data"


def is_dataset(data):
    """Whether `data` is a `tf.data.Dataset` or a `keras.utils.PyDataset`.

    Imports neither TensorFlow nor Keras: neither object can exist before
    its library is loaded.

    Example:

    >>> import keras, numpy as np
    >>> class Two(keras.utils.PyDataset):
    ...     def __len__(self):
    ...         return 2
    ...     def __getitem__(self, index):
    ...         return np.zeros((4, 3))
    >>> is_dataset(Two()), is_dataset([np.zeros((4, 3))])
    (True, False)
    """
    return _is_tf_dataset(data) or _is_py_dataset(data)


def _is_tf_dataset(data):
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(data, tf.data.Dataset)


def _is_py_dataset(data):
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(data, keras.utils.PyDataset)


def _is_array_like(data):
    return all(hasattr(data, a) for a in ("shape", "dtype", "__len__", "__getitem__"))


def _check_batch_size(batch_size):
    return validation.check_positive_int(
        batch_size,
        "batch_size",
        "E.g. batch_size=256 (lower it if the model runs out of memory).",
    )


def shape_text(shape):
    """`(None, 8, 8, 1)`-style text of a shape.

    Example:

    >>> shape_text((None, 8, 8, 1)), shape_text((6,))
    ('(None, 8, 8, 1)', '(6,)')
    """
    text = ", ".join("None" if d is None else str(d) for d in shape)
    return f"({text},)" if len(shape) == 1 else f"({text})"


def model_input_shape(model):
    """The shape of `model`'s one input, batch axis first, or None.

    None where the model does not say: a subclassed model (no `inputs`),
    or one of several inputs. Needs no Keras import.

    Example:

    >>> import keras
    >>> model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten()])
    >>> model_input_shape(model)
    (None, 8, 8, 1)
    """
    try:
        model_inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not model_inputs or len(model_inputs) != 1:
        return None
    return tuple(None if d is None else int(d) for d in model_inputs[0].shape)


def _fits(expected, got):
    """Whether shape `got` fits `expected`; None in either is a wildcard."""
    return len(got) == len(expected) and all(
        e is None or g is None or e == g for e, g in zip(expected, got, strict=True)
    )


def check_input_shape(
    input_shape, shape, where, *, model="backbone", items="images", stream=False
):
    """Refuses rows of `shape` (batch axis first) for an input of `input_shape`.

    Both shapes have the batch axis first; it is not compared, and None
    (unknown) in either is a wildcard. `input_shape` None (unknown) accepts
    anything. The error names both shapes and the fix.

    Args:
        input_shape: tuple or None. The model's input, e.g. from
            `model_input_shape`.
        shape: tuple. The data's, e.g. `(N, 16, 16, 1)`.
        where: str. The data in words, e.g. `"data.images"`.
        model: str. The model in words. Defaults to `"backbone"`.
        items: str. What the rows are. Defaults to `"images"`.
        stream: bool. Whether the rows are batches of a dataset (a shape of
            a single row then hints at an unbatched dataset).

    Example:

    >>> check_input_shape((None, 24, 24, 1), (5, 24, 24, 1), "images")
    >>> try:
    ...     check_input_shape((None, 24, 24, 1), (5, 16, 16, 1), "images")
    ... except ValueError as error:
    ...     print(str(error)[:73])
    The backbone takes images of shape (24, 24, 1) (its input is (None, 24, 2
    """
    if input_shape is None:
        return
    expected = tuple(input_shape[1:])
    got = tuple(shape[1:])
    if _fits(expected, got):
        return
    fix = f"Resize the {items} or build the {model} for their shape."
    if stream and _fits(expected, tuple(shape)):
        fix = (
            f"It seems to yield single {items}, not batches; batch it first "
            "(e.g. dataset.batch(256))."
        )
    elif len(got) == len(expected) - 1 and expected[-1] == 1:
        fix = f"Add the channel axis: {items}[..., None]."
    raise ValueError(
        f"The {model} takes {items} of shape {shape_text(expected)} (its input "
        f"is {shape_text(input_shape)}), but {where} has {items} of shape "
        f"{shape_text(got)}. {fix}"
    )


def open_input(
    data,
    fields=("images", "labels"),
    *,
    required=1,
    ignore_extra=False,
    single_examples=False,
    batch_size=256,
):
    """Returns an `Input` reading `data` (see the module docstring).

    Args:
        data: the images, as above, or an `Input` (returned as it is).
        fields: tuple. The leading names of `FIELDS` the caller reads, e.g.
            `("images", "labels")`.
        required: int. How many of `fields` (from the first) every element
            must hold; the others are read where present. An object with
            `.images` gives only these. Defaults to `1` (the images).
        ignore_extra: bool. Whether items after `fields` in a tuple are
            dropped (else refused). Defaults to `False`.
        single_examples: bool. Whether a stream's elements may be single
            examples (known by a scalar label), each read as a batch of
            one. Defaults to `False`.
        batch_size: int. Rows per batch of arrays (a dataset keeps its
            own batches). Defaults to `256`.

    Raises:
        TypeError: if `data` is of no kind above.
        ValueError: if it lacks a required field, holds no images, or its
            fields do not hold one row per image.

    Example:

    >>> import numpy as np
    >>> data = open_input((np.zeros((5, 2, 2, 1)), np.arange(5)), batch_size=2)
    >>> data.fields, data.num_examples, data.num_batches
    (('images', 'labels'), 5, 3)
    >>> [(b.images.shape[0], b.labels.tolist(), b.where) for b in data.batches()]
    [(2, [0, 1], 'images[0:2]'), (2, [2, 3], 'images[2:4]'), (1, [4], 'images[4:5]')]
    """
    layout = _Layout(tuple(fields), required, ignore_extra)
    if isinstance(data, Input):
        missing = layout.fields[len(data.fields) : layout.required]
        if missing or (len(data.fields) > len(layout.fields) and not ignore_extra):
            raise ValueError(
                f"The data must be {layout.text()}; this input holds "
                f"{', '.join(data.fields)}"
                + (f", without {', '.join(missing)}." if missing else ".")
            )
        return data
    batch_size = _check_batch_size(batch_size)
    if _is_tf_dataset(data):
        return _TFDataInput(data, layout, single_examples)
    if _is_py_dataset(data):
        return _PyDataInput(data, layout, single_examples)
    if isinstance(data, np.ndarray | list) or _is_array_like(data):
        parts, name = (data,), "data"
    elif hasattr(data, "images"):
        names = layout.fields[: layout.required]
        absent = [f for f in names if not hasattr(data, f)]
        if absent:
            raise ValueError(
                f"The data ({type(data).__name__}) has .images but no "
                f".{absent[0]}; it must be {layout.text()}: pass a tuple "
                f"({', '.join(names)}) instead."
            )
        parts = tuple(getattr(data, f) for f in names)
        name = "data.images"
    elif isinstance(data, tuple | dict):
        parts, name = layout.split(data, "data"), "images"
    else:
        raise TypeError(
            "data must be a NumPy array of images, an object with .images (e.g. "
            "kdpemb.datasets.synthetic_identities(...)), a tuple "
            f"{layout.text()}, a tf.data.Dataset or a keras.utils.PyDataset; "
            f"got {type(data).__name__}. Wrap a generator in a PyDataset or "
            "tf.data.Dataset.from_generator."
        )
    if len(parts) < layout.required:
        raise ValueError(f"data must be {layout.text()}, got images alone.")
    return _ArrayInput(parts, layout, batch_size, name)


class _Layout:
    """Which fields an element holds, and how to take them out of it."""

    def __init__(self, fields, required, ignore_extra):
        if fields != FIELDS[: len(fields)] or not 1 <= required <= len(fields):
            raise ValueError(f"fields must start {FIELDS}, got {fields}.")
        self.fields, self.required, self.ignore_extra = fields, required, ignore_extra

    def text(self):
        """E.g. `images or (images, labels)`."""
        forms = []
        for n in range(self.required, len(self.fields) + 1):
            names = list(self.fields[:n])
            if n == len(self.fields) and self.ignore_extra:
                names.append("...")
            forms.append(names[0] if len(names) == 1 else f"({', '.join(names)})")
        return " or ".join(forms)

    def split(self, element, where):
        """The present fields of one element, in order, as a tuple."""
        if isinstance(element, dict):
            parts = []
            for name in self.fields:
                if name not in element:
                    break
                parts.append(element[name])
            if len(parts) < self.required:
                missing = self.fields[len(parts)]
                keys = self.fields[: self.required]
                lookups = ", ".join(f"d[{name[:-1]!r}]" for name in keys)
                raise ValueError(
                    f"{where} is a dict without key {missing!r}; use keys "
                    f"{', '.join(map(repr, keys))}, or map it to a tuple, e.g. "
                    f"dataset.map(lambda d: ({lookups}))."
                )
            return tuple(parts)
        parts = tuple(element) if isinstance(element, list | tuple) else (element,)
        if len(parts) < self.required or (
            len(parts) > len(self.fields) and not self.ignore_extra
        ):
            got = (
                f"a {type(element).__name__} of {len(parts)} items"
                if isinstance(element, list | tuple)
                else "images alone"
            )
            extra = ""
            if len(parts) > len(self.fields):
                extra = " Drop the others (e.g. sample weights)."
            raise ValueError(f"{where} must be {self.text()}, got {got}.{extra}")
        return parts[: len(self.fields)]


def _check_images(images, where):
    if images.dtype == bool or images.dtype.kind not in "uif":
        raise ValueError(
            f"Images must be numbers, but {where} has dtype {images.dtype}; pass "
            "pixel values, e.g. uint8 or float32."
        )
    if images.ndim < 2:
        raise ValueError(
            f"{where} must be images (N, height, width, channels) or at least "
            f"(N, ...), got shape {shape_text(images.shape)}."
        )


def _as_images(images):
    """`images` as an array, keeping NumPy arrays and lazy array-likes."""
    if isinstance(images, list | tuple):
        shapes = {np.shape(image) for image in images}
        if len(shapes) > 1:
            raise ValueError(
                f"Images of inconsistent shapes: {sorted(shapes)[:3]}. Resize "
                "them to one size first."
            )
    if isinstance(images, np.ndarray) or _is_array_like(images):
        return images
    return np.asarray(images)


def _check_rows(parts, fields, where, hint=""):
    n = len(parts[0])
    for name, part in zip(fields[1:], parts[1:], strict=False):
        if np.shape(part)[:1] != (n,):
            raise ValueError(
                f"{name} must have shape ({n}, ...), one per image of {where}, "
                f"got {np.shape(part)}.{hint}"
            )


class Input:
    """Data read in order; from `open_input`.

    Attributes: `kind` ("array", "tf.data.Dataset" or "PyDataset"),
    `fields` (the names it holds), `num_examples` and `num_batches` (None
    where unknown before reading).
    """

    num_examples = None

    def batches(self, batch_size=None):
        """Yields a `Batch` per batch (of `batch_size` rows for arrays)."""
        raise NotImplementedError

    def arrays(self):
        """A `Batch` of whole arrays (a stream is read into memory)."""
        columns, first = [], None
        for batch in self.batches():
            if first is None:
                first = batch
            elif batch.images.shape[1:] != first.images.shape[1:]:
                raise ValueError(
                    "Images of inconsistent shapes: the first element has images "
                    f"of shape {first.images.shape[1:]}, {batch.where} has "
                    f"{batch.images.shape[1:]}. Resize them to one size first "
                    "(e.g. keras.layers.Resizing in a map)."
                )
            columns.append([part for part in batch[:3] if part is not None])
        parts = (np.concatenate(column) for column in zip(*columns, strict=True))
        return Batch(*parts)


class _ArrayInput(Input):
    """Arrays in memory (or lazy), cut into batches."""

    kind = "array"
    is_stream = False

    def __init__(self, parts, layout, batch_size, name):
        images = _as_images(parts[0])
        self.name, self.batch_size = name, batch_size
        self.shape = tuple(int(d) for d in images.shape)
        if len(self.shape) < 2:
            raise ValueError(
                f"{name} must be images (N, height, width, channels) or at least "
                f"(N, ...), got shape {shape_text(self.shape)}."
            )
        self.num_examples = self.shape[0]
        if self.num_examples == 0:
            raise ValueError(
                f"{name} holds no images (shape {shape_text(self.shape)}): there "
                "are no examples to read."
            )
        # The dtype of a lazy array-like is that of what indexing it gives.
        probe = images[:1] if isinstance(images, np.ndarray) else np.asarray(images[:1])
        _check_images(probe, name)
        self.dtype = probe.dtype
        others = tuple(np.asarray(part) for part in parts[1:])
        self.fields = layout.fields[: len(parts)]
        _check_rows((images, *others), self.fields, name)
        self._parts = (images, *others)
        self.num_batches = -(-self.num_examples // batch_size)

    def batches(self, batch_size=None):
        step = batch_size or self.batch_size
        for start in range(0, self.num_examples, step):
            stop = min(start + step, self.num_examples)
            parts = [np.asarray(part[start:stop]) for part in self._parts]
            where = f"{self.name}[{start}:{stop}]"
            _check_images(parts[0], where)
            yield Batch(*parts, where=where)

    def arrays(self):
        return Batch(*self._parts)


class _StreamInput(Input):
    """Elements of a tf.data.Dataset or a PyDataset, read in order."""

    is_stream = True

    def __init__(self, layout, single_examples):
        self.layout, self.single_examples = layout, single_examples
        self._fields = None

    @property
    def fields(self):
        """The fields of the first element (read from its structure)."""
        if self._fields is None:
            where = f"the first element of the {self.kind}"
            parts = self.layout.split(self._structure(), where)
            self._fields = self.layout.fields[: len(parts)]
        return self._fields

    def batches(self, batch_size=None):
        count, rows, step = None, 0, 0
        for step, element in enumerate(self._elements(), start=1):
            where = f"element {step - 1} of the {self.kind}"
            parts = [np.asarray(p) for p in self.layout.split(element, where)]
            if count is None:
                count = len(parts)
            elif len(parts) != count:
                raise ValueError(
                    f"{where} holds {', '.join(self.layout.fields[: len(parts)])} "
                    "but the first element holds "
                    f"{', '.join(self.layout.fields[:count])}; yield the same "
                    "structure in every element."
                )
            single = len(parts) > 1 and parts[1].ndim == 0
            if single and self.single_examples:
                parts = [part[None] for part in parts]
            _check_images(parts[0], where)
            hint = ""
            if single:
                hint = (
                    " It seems to yield single examples; batch it first (e.g. "
                    "dataset.batch(256))."
                )
            _check_rows(parts, self.layout.fields, where, hint)
            rows += len(parts[0])
            yield Batch(*parts, where=where)
        if not rows:
            raise ValueError(
                f"The {self.kind} yielded no images ({step} elements); there is "
                "nothing to read."
            )


class _TFDataInput(_StreamInput):
    kind = "tf.data.Dataset"

    def __init__(self, dataset, layout, single_examples):
        super().__init__(layout, single_examples)
        self.dataset = dataset
        cardinality = int(dataset.cardinality())
        if cardinality == -1:  # tf.data.INFINITE_CARDINALITY
            raise ValueError(
                "The tf.data.Dataset repeats forever, but it is read once, in "
                "order. Remove .repeat() or end it with .take(num_batches)."
            )
        self.num_batches = cardinality if cardinality >= 0 else None

    def _elements(self):
        return self.dataset.as_numpy_iterator()

    def _structure(self):
        import tensorflow as tf

        # The structure of the elements, without reading any.
        return tf.nest.map_structure(lambda _: np.empty(0), self.dataset.element_spec)


class _PyDataInput(_StreamInput):
    kind = "PyDataset"

    def __init__(self, dataset, layout, single_examples):
        super().__init__(layout, single_examples)
        self.dataset = dataset
        num_batches = dataset.num_batches
        if num_batches is None:
            raise ValueError(
                "The PyDataset is infinite (num_batches is None), but it is read "
                "once, in order. Give it a finite num_batches (or __len__)."
            )
        self.num_batches = int(num_batches)

    def _elements(self):
        for index in range(self.num_batches):
            yield self.dataset[index]

    def _structure(self):
        if not self.num_batches:
            raise ValueError(
                "The PyDataset is empty (its length is 0): there are no images to read."
            )
        return self.dataset[0]
