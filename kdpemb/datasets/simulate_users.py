"""User ids for labelled data that has none, such as Fashion-MNIST."""

import warnings

import numpy as np

from kdpemb import _validation as validation


def _check_count(name, value):
    return validation.check_positive_int(value, name, f"Pass e.g. {name}=10.")


def simulate_users(labels, num_users, classes_per_user=None, seed=0):
    """Assign each example of a labelled dataset to a simulated user.

    Real datasets such as Fashion-MNIST have no user ids, but user-level
    differential privacy needs them. With `classes_per_user=None` the split
    is IID: a seeded random permutation of the examples is cut into
    `num_users` parts whose sizes differ by at most one. With
    `classes_per_user=c` the split is skewed, as with handwriting or photo
    users: every user holds `min(c, num_classes)` distinct classes, the
    classes are spread evenly so that each is held by
    `num_users * c / num_classes` users (rounded down or up), and each
    class's examples are divided as evenly as possible among its holders.
    Users who receive no examples (more users than examples, or a class with
    fewer examples than holders, which can also leave a user with fewer
    than `c` classes) are dropped with one `UserWarning`, and the remaining
    ids are renumbered `0..U-1`. The result depends only on the arguments.

    Args:
        labels: array-like of int `(N,)`. Class of each example,
            non-negative integers (floats with no fractional part are
            accepted).
        num_users: int. Number of users to simulate.
        classes_per_user: int or None. Distinct classes each user holds;
            `None` for an IID split. Defaults to `None`.
        seed: int. Seed of the random split. Defaults to `0`.

    Returns:
        int64 array `(N,)`: the user id of each example, dense in `0..U-1`
        with `U <= num_users`.

    Raises:
        ValueError: if `labels` is not a 1-D array of non-negative integers,
            `num_users` or `classes_per_user` is not a positive int, or
            `num_users * classes_per_user` is below the number of classes
            (some class would have no user to hold it).

    Example:

    >>> import numpy as np
    >>> labels = np.repeat(np.arange(4), 6)          # 4 classes, 24 examples
    >>> users = simulate_users(labels, num_users=8)  # IID: 3 examples each
    >>> np.bincount(users).tolist()
    [3, 3, 3, 3, 3, 3, 3, 3]
    >>> users = simulate_users(labels, num_users=8, classes_per_user=2)
    >>> [len(np.unique(labels[users == u])) for u in range(8)]
    [2, 2, 2, 2, 2, 2, 2, 2]
    """
    labels = validation.check_labels(labels)
    num_users = _check_count("num_users", num_users)
    if classes_per_user is not None:
        classes_per_user = _check_count("classes_per_user", classes_per_user)
    rng = np.random.default_rng(seed)
    n = labels.size
    user_ids = np.empty(n, np.int64)
    if classes_per_user is None:
        for user, part in enumerate(np.array_split(rng.permutation(n), num_users)):
            user_ids[part] = user
    else:
        classes, counts = np.unique(labels, return_counts=True)
        per_user = min(classes_per_user, classes.size)
        if num_users * per_user < classes.size:
            raise ValueError(
                f"{num_users} users holding {per_user} classes each cover only "
                f"{num_users * per_user} of the {classes.size} classes, so some "
                "examples would have no user; use num_users >= "
                f"{-(-classes.size // per_user)} or a larger classes_per_user."
            )
        # Users take consecutive windows of `per_user` classes on a cycle
        # through a shuffled class order: each window holds distinct classes
        # (per_user <= num_classes) and each class is in the floor or ceil of
        # num_users * per_user / num_classes windows.
        position = rng.permutation(classes.size)  # Class i sits at position[i].
        class_at = np.argsort(position)
        window_of_user = rng.permutation(num_users)
        holders = [[] for _ in classes]
        for user in range(num_users):
            start = int(window_of_user[user]) * per_user
            for j in range(per_user):
                holders[class_at[(start + j) % classes.size]].append(user)
        by_class = np.split(np.argsort(labels, kind="stable"), np.cumsum(counts)[:-1])
        for members, users_of_class in zip(by_class, holders, strict=True):
            users_of_class = rng.permutation(users_of_class)
            parts = np.array_split(rng.permutation(members), users_of_class.size)
            for user, part in zip(users_of_class, parts, strict=True):
                user_ids[part] = user
    kept, user_ids = np.unique(user_ids, return_inverse=True)
    if kept.size < num_users:
        warnings.warn(
            f"{num_users - kept.size} of {num_users} simulated users received "
            f"no examples and were dropped; {kept.size} users remain.",
            UserWarning,
            stacklevel=2,
        )
    return user_ids.astype(np.int64).reshape(n)
