"""Image data grouped by user, with no download needed.

- `synthetic_identities`: the embedded default, any number of identities.
- `load_fashion_mnist`, `load_mnist`: real data from local files.
- `simulate_users`: user ids for data that has none.
- `from_directory`: your own photos in `root/<user>/<identity>/*.png`.

Every function returns a `UserImages` (or arrays for the MNIST loaders) that
`kdpemb.data.VirtualClients` takes. Nothing here imports Keras.

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
from kdpemb.errors import DatasetNotFoundError  # noqa: F401 (see errors)

__all__ = [
    "SyntheticImages",
    "UserImages",
    "from_directory",
    "load_fashion_mnist",
    "load_mnist",
    "simulate_users",
    "synthetic_identities",
]
