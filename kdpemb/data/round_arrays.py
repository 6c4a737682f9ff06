"""The arrays of one round, gathered from its client plans (`ClientPlan`).

`round_arrays` lays the planned examples of each client out as one row of
fixed-shape arrays (images, local and global labels, masks) and
`element_spec` gives their shapes; see `VirtualClients` for the keys.
Keras-free.

Example:

>>> import numpy as np
>>> from kdpemb.data.round_plan import ClientPlan
>>> plan = ClientPlan(users=np.array([0]), example_index=np.array([[2, -1]]))
>>> images, labels = np.arange(4).reshape(4, 1), np.array([5, 6, 7, 8])
>>> element = round_arrays([plan], (2, 1, 2), images, labels, (1,))
>>> element["global_labels"].tolist(), element["client_mask"].tolist()
([[[7, 0]], [[0, 0]]], [True, False])
"""

import numpy as np

# With sampling="epochs", each round also says which epoch layout (who is
# in which round) it is from, and its position in that epoch.
POSITION_KEYS = ("epoch_id", "round_in_epoch")


def element_spec(rows, local_steps, batch_size, image_shape, image_dtype, *, keys=()):
    """`{key: (shape, dtype)}` of a round of `rows` client rows; `keys`
    names the extra int32 `[rows]` arrays (e.g. `POSITION_KEYS`).

    Example:

    >>> element_spec(4, 1, 2, (8, 8, 3), np.uint8)["images"]
    ((4, 1, 2, 8, 8, 3), dtype('uint8'))
    """
    m, s, b = rows, local_steps, batch_size
    grid = (m, s, b)
    return {
        "images": ((*grid, *image_shape), np.dtype(image_dtype)),
        "labels": (grid, np.dtype(np.int32)),
        "global_labels": (grid, np.dtype(np.int32)),
        "example_mask": (grid, np.dtype(bool)),
        "client_mask": ((m,), np.dtype(bool)),
        "num_local_classes": ((m,), np.dtype(np.int32)),
        **{key: ((m,), np.dtype(np.int32)) for key in keys},
    }


def round_arrays(plans, grid, images, labels, image_shape):
    """The round's arrays over `grid` = `(m, local_steps, batch_size)`: the
    first `len(plans)` of the m rows from `plans` (in order), the rest
    masked; labels are re-indexed to 0..c-1 inside each client. `images`
    (each of `image_shape`) and `labels` are indexed by example."""
    m, s, b = grid
    index = np.full((m, s, b), -1, dtype=np.int64)
    local = np.zeros((m, s, b), dtype=np.int32)
    num_local = np.zeros(m, dtype=np.int32)
    for row, plan in enumerate(plans):
        grid = plan.example_index
        index[row] = grid
        used = grid >= 0
        classes, local_labels = np.unique(labels[grid[used]], return_inverse=True)
        local[row][used] = local_labels
        num_local[row] = classes.size
    example_mask = index >= 0
    client_mask = np.zeros(m, dtype=bool)
    client_mask[: len(plans)] = True
    global_labels = np.where(example_mask, labels[np.maximum(index, 0)], 0)
    return {
        "images": gather(images, index, example_mask, image_shape),
        "labels": local,
        "global_labels": global_labels.astype(np.int32),
        "example_mask": example_mask,
        "client_mask": client_mask,
        "num_local_classes": num_local,
    }


def gather(images, index, mask, image_shape):
    """`images[index]` where `mask`, zeros elsewhere; reads only the masked
    rows of an array-like that is not a NumPy array."""
    flat_index = index.reshape(-1)
    flat_mask = mask.reshape(-1)
    out = np.empty((flat_index.size, *image_shape), dtype=images.dtype)
    if isinstance(images, np.ndarray):
        np.take(images, np.maximum(flat_index, 0), axis=0, out=out)
        out[~flat_mask] = 0
    else:
        out[...] = 0
        out[flat_mask] = np.asarray(images[flat_index[flat_mask]])
    return out.reshape(*index.shape, *image_shape)
