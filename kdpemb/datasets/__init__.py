"""Image data grouped by user, with no download needed.

- `synthetic_identities`: the embedded default, any number of identities.
- `load_fashion_mnist`, `load_mnist`: real data from local files.
- `simulate_users`: user ids for data that has none.
- `from_directory`: your own photos in `root/<user>/<identity>/*.png`.
- `write_user_shards`, `UserShards`: user data on disk, grouped by user in
  memory-mapped shards, for datasets larger than memory.

Every loader returns a `UserImages` (or arrays for the MNIST loaders) that
`kdpemb.data.VirtualClients` takes, as it takes a `UserShards`. Importing
this package imports no Keras, nor does writing or opening shards.

Example:

>>> import kdpemb
>>> data = kdpemb.datasets.synthetic_identities(
...     num_identities=4, images_per_identity=2, image_size=8)
>>> data.images.shape, data.num_users
((8, 8, 8, 3), 4)
"""

from kdpemb.datasets.directory import from_directory
from kdpemb.datasets.mnist_files import load_fashion_mnist, load_mnist
from kdpemb.datasets.simulate_users import simulate_users
from kdpemb.datasets.synthetic_identities import SyntheticImages, synthetic_identities
from kdpemb.datasets.user_images import UserImages
from kdpemb.datasets.user_shards_reader import ShardedArray, UserShards
from kdpemb.datasets.user_shards_writer import write_user_shards
from kdpemb.errors import DatasetNotFoundError  # noqa: F401 (see errors)

__all__ = [
    "ShardedArray",
    "SyntheticImages",
    "UserImages",
    "UserShards",
    "from_directory",
    "load_fashion_mnist",
    "load_mnist",
    "simulate_users",
    "synthetic_identities",
    "write_user_shards",
]
