"""Split in 0.x (issue 32); this path goes in the next release.

`UserShards` and `ShardedArray` are now in `user_shards_reader`,
`write_user_shards` and the writer's sizes in `user_shards_writer`, and
the format's names in `shard_format` (all under `kdpemb.datasets`). Each
old name is read from its new module, with a DeprecationWarning.
"""

import warnings

from kdpemb.datasets import shard_format, user_shards_reader, user_shards_writer

_MOVED = {
    **dict.fromkeys(("UserShards", "ShardedArray"), user_shards_reader),
    **dict.fromkeys(
        (
            "write_user_shards",
            "SHARD_BYTES",
            "BUCKET_ROWS",
            "MAX_BUCKETS",
            "STREAM_BUCKETS",
            "COPY_ROWS",
            "COPY_BYTES",
        ),
        user_shards_writer,
    ),
    **dict.fromkeys(("FORMAT", "VERSION", "MANIFEST", "INDEX_FILES"), shard_format),
}


def __getattr__(name):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _MOVED[name]
    warnings.warn(
        f"kdpemb.datasets.user_shards.{name} is now {module.__name__}.{name}; "
        "the old path goes in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(module, name)
