"""Training rows kept on the device, so that a step receives only indices.

A step of a linear head on [B, d] features is a fraction of a millisecond
of device work; gathering B rows on the host and copying them over costs
as much again. `DeviceRows` copies the features and labels to the device
once per fit, the batches carry the sampled indices (a few kilobytes),
and the step gathers its rows on the device. Rows that do not fit in
device memory stay on the host (`hold` answers False).

The device copies are not model state: no weight, checkpoint or saved
model holds them.
"""

import keras

from kdpemb.models._shared import backends


class DeviceRows:
    """The rows of the current fit, on the device, or on the host if too big.

    Example:

    >>> import numpy as np
    >>> from kdpemb.data import PoissonIndices
    >>> rows = DeviceRows()
    >>> features = np.arange(12, dtype="float32").reshape(6, 2)
    >>> rows.hold(features, np.arange(6, dtype="int32"))
    True
    >>> batch = next(iter(rows.batches(PoissonIndices(6, None, steps=1))))
    >>> x, y, mask = rows.gather(batch)
    >>> [keras.ops.convert_to_numpy(a).tolist() for a in (y, mask)]
    [[0, 1, 2, 3, 4, 5], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]
    """

    def __init__(self):
        self.on_device = False
        self.retrace = False  # Set when the step must be traced anew.
        self._rows = None

    def hold(self, *arrays):
        """Copies `arrays` to the device; False when they do not fit there."""
        was_on_device = self.on_device
        try:
            self._rows, retrace = backends.current().hold_rows(arrays, self._rows)
        except Exception as error:  # Re-raised below unless out of memory.
            if not _out_of_memory(error):
                raise
            self._rows, retrace = None, False
            self.on_device = False
        else:
            self.on_device = True
        self.retrace = retrace or self.on_device != was_on_device
        return self.on_device

    def batches(self, sampler, epochs=1):
        """The dataset to fit on for `epochs` epochs (with
        `steps_per_epoch=len(sampler)`): `sampler`'s indices, with what the
        backend needs to reach the rows."""
        return backends.current().rows_batches(sampler, self._rows, epochs)

    def gather(self, data):
        """`(*rows[indices], mask)` of a batch from `batches`, on the device."""
        indices, rows, mask = backends.current().gather_inputs(data, self._rows)
        indices = keras.ops.convert_to_tensor(indices)
        return (*(keras.ops.take(row, indices, axis=0) for row in rows), mask)


def _out_of_memory(error):
    text = f"{type(error).__name__} {error}"
    return isinstance(error, MemoryError) or any(
        mark in text for mark in ("RESOURCE_EXHAUSTED", "ResourceExhausted")
    )
