"""The one check of the trainers that run on one device only.

`DPModel` and `LastLayerDPClassifier` train on one device for now: under a
`tf.distribute` strategy with several replicas, or with a
`keras.distribution` set, each replica would sample, clip and noise on
its own, which the accounting does not describe. They refuse before any
step.

Example:

>>> check_single_device("DPModel")  # No strategy, no distribution: fine.
"""

import keras


def check_single_device(owner, why=""):
    """Refuses a multi-replica `tf.distribute` strategy or a
    `keras.distribution`, naming `owner` (and `why`, e.g. "a linear head
    is cheap") and the fix."""
    because = f" ({why})" if why else ""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if (
            tf.distribute.has_strategy()
            and tf.distribute.get_strategy().num_replicas_in_sync > 1
        ):
            raise ValueError(
                f"{owner} trains on one device for now{because}; build and fit "
                "it outside the tf.distribute strategy scope."
            )
    if keras.distribution.distribution() is not None:
        raise ValueError(
            f"{owner} trains on one device for now{because}; fit it with no "
            "keras.distribution set."
        )
