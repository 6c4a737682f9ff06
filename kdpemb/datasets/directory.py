"""Your own photos from a directory tree, grouped by user and identity."""

import pathlib
import warnings

import numpy as np
from PIL import Image, ImageOps

from kdpemb.datasets.user_images import UserImages

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
LAYOUTS = ("auto", "users", "identities")
COLOR_MODES = {"rgb": "RGB", "grayscale": "L"}


def _visible(folder):
    """Non-hidden entries of `folder`, sorted by name."""
    return sorted(
        (p for p in folder.iterdir() if not p.name.startswith(".")),
        key=lambda p: p.name,
    )


def _subdirs(folder):
    return [p for p in _visible(folder) if p.is_dir()]


def _images(folder):
    return [
        p
        for p in _visible(folder)
        if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
    ]


def _detect_layout(root, top):
    """'users' or 'identities' from what the top-level folders hold."""
    with_images, with_folders = [], []
    for folder in top:
        has_images, has_folders = bool(_images(folder)), bool(_subdirs(folder))
        if has_images and has_folders:
            raise ValueError(
                f"{folder} holds both image files and subfolders, so the layout "
                f"of {root} is ambiguous. Use root/<user>/<identity>/*.png "
                "(layout='users') or root/<identity>/*.png (layout='identities'), "
                "or pass layout= to say which."
            )
        if has_images:
            with_images.append(folder)
        elif has_folders:
            with_folders.append(folder)
    if with_images and with_folders:
        raise ValueError(
            f"{root} mixes layouts: {with_images[0]} holds images directly "
            f"(root/<identity>/*.png) but {with_folders[0]} holds subfolders "
            "(root/<user>/<identity>/*.png). Put every folder in one layout."
        )
    return "users" if with_folders else "identities"


def _check_image_size(image_size):
    if image_size is None:
        return None
    try:
        height, width = image_size
        ok = all(
            isinstance(v, int | np.integer) and not isinstance(v, bool) and v > 0
            for v in (height, width)
        )
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"image_size must be a pair of positive ints (height, width), "
            f"got {image_size!r}; e.g. image_size=(64, 64)."
        )
    return int(height), int(width)


def _decode(path, mode, image_size):
    try:
        with Image.open(path) as image:
            image = ImageOps.exif_transpose(image).convert(mode)
            if image_size is not None and image.size != image_size[::-1]:
                image = image.resize(image_size[::-1], Image.Resampling.BILINEAR)
            array = np.asarray(image, dtype=np.uint8)
    except Exception as e:
        raise ValueError(
            f"Cannot decode the image file {path}: {type(e).__name__}: {e}. "
            "Remove or replace it."
        ) from e
    return array.reshape(*array.shape[:2], -1)


def from_directory(path, image_size=None, color_mode="rgb", layout="auto"):
    """Load your own photos from folders named after users and identities.

    Two layouts are read. With `layout="users"`, `root/<user>/<identity>/`
    holds one user's images of one identity; identity names are global, so
    a folder of the same name under two users is the same label. With
    `layout="identities"`, `root/<identity>/` holds the images of one
    identity, and each identity is its own user. `layout="auto"` picks
    "identities" when the top-level folders hold image files and "users"
    when they hold subfolders. Image files are `.png`, `.jpg` and `.jpeg`
    (any case), decoded with Pillow (honouring EXIF orientation); other
    files, and every name starting with ".", are ignored. Labels and user
    ids index the sorted identity and user folder names, and images are in
    sorted user, identity, file order, so the result is deterministic. Users
    (or, in the "identities" layout, identity folders) with no images are
    dropped with one `UserWarning` that counts them.

    Args:
        path: str or path-like. The root folder.
        image_size: tuple of int or None. `(height, width)` to resize every
            image to (bilinear); with `None` all images must share one size.
            Defaults to `None`.
        color_mode: str. "rgb" (3 channels) or "grayscale" (1 channel).
            Defaults to `"rgb"`.
        layout: str. "auto", "users" or "identities", as above. Defaults to
            `"auto"`.

    Returns:
        `UserImages`: uint8 images `(N, H, W, C)`, int64 labels and user ids
        `(N,)`, and the identity and user folder names as `class_names` and
        `user_names`.

    Raises:
        FileNotFoundError: if `path` does not exist.
        NotADirectoryError: if `path` is a file.
        ValueError: if the layout cannot be told or is mixed, no images are
            found, a file cannot be decoded, or images differ in size with
            no `image_size` (each message names the files or folders).

    Example:

    >>> import pathlib, tempfile
    >>> from PIL import Image
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     root = pathlib.Path(tmp)
    ...     for user, identity in [("ann", "cat"), ("ann", "dog"), ("bob", "cat")]:
    ...         (root / user / identity).mkdir(parents=True)
    ...         Image.new("RGB", (8, 6)).save(root / user / identity / "1.png")
    ...     data = from_directory(root)
    ...     small = from_directory(root, image_size=(4, 4), color_mode="grayscale")
    >>> data.images.shape, data.labels.tolist(), data.user_ids.tolist()
    ((3, 6, 8, 3), [0, 1, 0], [0, 0, 1])
    >>> data.class_names, data.user_names
    (('cat', 'dog'), ('ann', 'bob'))
    >>> small.images.shape
    (3, 4, 4, 1)
    """
    root = pathlib.Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"No such directory: {root}")
    if not root.is_dir():
        raise NotADirectoryError(
            f"{root} is a file; pass the folder that holds the user or identity "
            "folders."
        )
    if color_mode not in COLOR_MODES:
        raise ValueError(
            f"color_mode must be one of {', '.join(map(repr, COLOR_MODES))}, "
            f"got {color_mode!r}."
        )
    if layout not in LAYOUTS:
        raise ValueError(
            f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}."
        )
    image_size = _check_image_size(image_size)

    loose = _images(root)
    if loose:
        raise ValueError(
            f"{root} holds image files directly (e.g. {loose[0].name}); put them "
            "in folders: root/<identity>/*.png or root/<user>/<identity>/*.png."
        )
    top = _subdirs(root)
    if layout == "auto":
        layout = _detect_layout(root, top)

    # (user name, identity name, file) for every image, in sorted order.
    entries = []
    empty = 0
    for folder in top:
        if layout == "users":
            found = [
                (folder.name, identity.name, file)
                for identity in _subdirs(folder)
                for file in _images(identity)
            ]
        else:
            found = [(folder.name, folder.name, file) for file in _images(folder)]
        empty += not found
        entries += found
    if not entries:
        expected = (
            "root/<user>/<identity>/*.png"
            if layout == "users"
            else "root/<identity>/*.png"
        )
        raise ValueError(
            f"No image files ({', '.join(IMAGE_EXTENSIONS)}) found under {root} "
            f"with layout {layout!r}, which expects {expected}."
        )
    if empty:
        kind = "user" if layout == "users" else "identity"
        warnings.warn(
            f"{empty} of {len(top)} {kind} folders in {root} hold no images and "
            f"were dropped; {len(top) - empty} remain.",
            UserWarning,
            stacklevel=2,
        )

    mode = COLOR_MODES[color_mode]
    images = []
    first = None
    for _, _, file in entries:
        array = _decode(file, mode, image_size)
        if first is None:
            first = (file, array.shape)
        elif array.shape != first[1]:
            raise ValueError(
                f"Images differ in size: {first[0]} is {first[1][0]}x{first[1][1]} "
                f"but {file} is {array.shape[0]}x{array.shape[1]} (height x "
                "width). Pass image_size=(height, width) to resize them all."
            )
        images.append(array)

    user_names, user_ids = np.unique([e[0] for e in entries], return_inverse=True)
    class_names, labels = np.unique([e[1] for e in entries], return_inverse=True)
    return UserImages(
        np.stack(images),
        labels=labels.astype(np.int64).reshape(-1),
        user_ids=user_ids.astype(np.int64).reshape(-1),
        class_names=tuple(str(n) for n in class_names),
        user_names=tuple(str(n) for n in user_names),
    )
