"""Moved to `kdpemb.datasets.inputs` in 0.x (issue 32); this path goes next.

Every name of the old module is read from the new one, with a
DeprecationWarning.
"""

import warnings

from kdpemb.datasets import inputs as _new


def __getattr__(name):
    if name.startswith("__") or not hasattr(_new, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"kdpemb.data.inputs.{name} is now kdpemb.datasets.inputs.{name}; the "
        "old path goes in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_new, name)
