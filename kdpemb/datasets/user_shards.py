"""Split in 0.x (issue 32); this path goes in the next release.

`UserShards` and `ShardedArray` are now in `user_shards_reader`,
`write_user_shards` and the writer's sizes in `user_shards_writer`, and
the format's names in `shard_format` (all under `kdpemb.datasets`). Each
old name is read from its new module, with a DeprecationWarning.
"""

from kdpemb._moved import moved_names

_READER = "kdpemb.datasets.user_shards_reader"
_WRITER = "kdpemb.datasets.user_shards_writer"
_FORMAT = "kdpemb.datasets.shard_format"
__getattr__ = moved_names(
    __name__,
    {
        **dict.fromkeys(("UserShards", "ShardedArray"), _READER),
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
            _WRITER,
        ),
        **dict.fromkeys(("FORMAT", "VERSION", "MANIFEST", "INDEX_FILES"), _FORMAT),
    },
)
