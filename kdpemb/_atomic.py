"""Atomic file replacement: a reader sees the old file or the new one, whole.

`atomic_path(path)` gives a temporary path in the same directory; when the
block ends without an exception the temporary file is flushed to disk
(fsync) and `os.replace`d onto `path`, and the directory entry is synced.
A process killed inside the block leaves `path` untouched (and a stray
temporary file, whose name starts with `.partial-`); one killed after
leaves the new file. POSIX `rename` is atomic within a file system, which
is why the temporary file sits next to the target.

Example:

>>> import os, tempfile
>>> target = os.path.join(tempfile.mkdtemp(), "state.json")
>>> write_text(target, '{"steps": 3}')
>>> open(target).read()
'{"steps": 3}'
>>> [name for name in os.listdir(os.path.dirname(target))]
['state.json']
"""

import contextlib
import os
import secrets

PARTIAL_PREFIX = ".partial-"


def _fsync_path(path, directory=False):
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # Directories cannot be opened on some platforms.
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path, durable=True):
    """Yields a temporary path; on success, moves it onto `path` atomically.

    `durable=False` skips the fsyncs: the replacement is still atomic for a
    killed process (the kernel keeps what was written), but not across a
    power loss or an operating-system crash.

    The temporary name ends with the target's name, so suffix checks (such
    as Keras' ".keras" and ".weights.h5") accept it. On an exception the
    temporary file is removed and `path` is left as it was.
    """
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(
        directory, f"{PARTIAL_PREFIX}{secrets.token_hex(4)}-{name}"
    )
    try:
        yield temporary
        if durable:
            _fsync_path(temporary)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    if durable:
        _fsync_path(directory, directory=True)


def write_text(path, text, durable=True):
    """Writes `text` to `path` atomically (see `atomic_path`)."""
    with atomic_path(path, durable) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
