"""A quiet console: the backends' own chatter kept off it, unless asked for.

`import kdpemb` calls `install()`. Unless the environment variable
`KDPEMB_BACKEND_LOGS` is set (to anything but "", "0", "false", "no" or
"off"), it:

- sets `TF_CPP_MIN_LOG_LEVEL=2` if it is unset (TensorFlow's and XLA's
  C++ info and warning lines hidden, their errors shown; a value you set
  wins);
- holds back what native code writes to the process's standard error
  (file descriptor 2) during the first `import tensorflow`, by Keras or
  anyone, and TensorFlow's device discovery right after it: the start-up
  lines that no log level hides (absl's "All log messages before
  absl::InitializeLog()", oneDNN, CPU instructions, CUDA probing such as
  `failed call to cuInit`). Python's own writes to `sys.stderr` still
  reach the console, and if the import fails what was held back is
  written out before the error;
- drops TensorFlow's "triggered tf.function retracing" warning when it is
  about Keras' own train, test or predict step: Keras makes one such
  function per model, so the warning counts the models a script builds
  (an audit builds one per mechanism), not a retrace of one of them.

kdpemb's own use of TensorFlow's vectoriser, where it falls back to a
while-loop for an op ("Conv2DBackpropFilter uses a while_loop. Fix
that!"), is quieted where it is called (`vectorizer_logs_quieted`).
Whatever the setting, Python collects unreachable objects at exit before
it starts tearing itself down, so that an iterator left by a fit that
stopped early (a `PrivacyBudget` stop) is finalised while its generator
can still run, not with TensorFlow's "Error occurred when finalizing
GeneratorDataset iterator" warning.

TensorFlow imported before kdpemb has printed its start-up lines already,
and read `TF_CPP_MIN_LOG_LEVEL` then: import kdpemb first (or set the
variable yourself before TensorFlow starts).
"""

import atexit
import contextlib
import gc
import importlib.abc
import importlib.util
import io
import logging
import os
import sys
import tempfile

VARIABLE = "KDPEMB_BACKEND_LOGS"
LOG_LEVEL_DEFAULT = "2"
_OFF = ("", "0", "false", "no", "off")
_installed = []


def backend_logs_shown():
    """Whether `KDPEMB_BACKEND_LOGS` asks for the backends' own lines."""
    return os.environ.get(VARIABLE, "").strip().lower() not in _OFF


def install():
    """Quiets the backends for this process (see the module); idempotent."""
    if _installed:
        return
    _installed.append(True)
    atexit.register(_collect_before_exit)
    if backend_logs_shown():
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", LOG_LEVEL_DEFAULT)
    logging.getLogger("tensorflow").addFilter(_KerasStepRetracing())
    if "tensorflow" not in sys.modules:
        sys.meta_path.insert(0, _QuietTensorFlowImport())


def _collect_before_exit():
    gc.collect()  # Finalisers run while every module is still there.


class _KerasStepRetracing(logging.Filter):
    """Drops the frequent-retracing warning about Keras' step functions."""

    def filter(self, record):
        try:
            message = record.getMessage()
        except Exception:  # A record that cannot format is not ours to judge.
            return True
        return not (
            "triggered tf.function retracing" in message
            and "TensorFlowTrainer." in message
        )


class _VectorizerNotes(logging.Filter):
    """Drops the records of TensorFlow's vectoriser (`parallel_for`); with
    `keep_errors`, only those below ERROR."""

    def __init__(self, keep_errors):
        super().__init__()
        self.keep_errors = keep_errors

    def filter(self, record):
        if self.keep_errors and record.levelno >= logging.ERROR:
            return True
        return "parallel_for" not in record.pathname.replace("\\", "/")


@contextlib.contextmanager
def vectorizer_logs_quieted(keep_errors=True):
    """TensorFlow's vectoriser's notes dropped inside the block.

    `tf.vectorized_map` logs a warning for each op it loops over rather
    than vectorises ("Conv2DBackpropFilter uses a while_loop. Fix
    that!"): the values are the same, only slower. `keep_errors=False`
    also drops its errors, for a caller that handles a failed conversion
    itself (the vectoriser logs the graph it could not convert before it
    raises). With `KDPEMB_BACKEND_LOGS` set, nothing is dropped.
    """
    if backend_logs_shown():
        yield
        return
    tf_logger = logging.getLogger("tensorflow")
    quiet = _VectorizerNotes(keep_errors)
    tf_logger.addFilter(quiet)
    try:
        yield
    finally:
        tf_logger.removeFilter(quiet)


# The first `import tensorflow`.


class _QuietTensorFlowImport(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` once, with a loader that holds back its lines."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "tensorflow" or path is not None:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # Once: later imports are not ours.
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _QuietLoader(spec.loader)
        return spec


class _QuietLoader(importlib.abc.Loader):
    """`loader`, whose `exec_module` runs with native stderr held back."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # The module keeps the real loader, as if this one had never been.
        module.__loader__ = module.__spec__.loader = self._loader
        with native_stderr_held() as held:
            self._loader.exec_module(module)
            try:  # Device discovery prints the CUDA probing lines.
                module.config.list_physical_devices()
            except Exception:
                held.show()  # The error comes again, with its lines, at use.


class _Held:
    """Whether what `native_stderr_held` held back is to be shown after all."""

    def __init__(self):
        self.shown = False

    def show(self):
        self.shown = True


class _Passthrough(io.TextIOBase):
    """`sys.stderr` while fd 2 is held back: writes go to the console's
    descriptor, and to the original stream once released (a logging
    handler made meanwhile keeps this object and must keep working)."""

    def __init__(self, original, fd):
        self._original = original
        self._fd = fd

    def release(self):
        self._fd = None

    def write(self, text):
        if self._fd is None:
            return self._original.write(text)
        data = text.encode(self.encoding or "utf-8", self.errors or "replace")
        while data:
            data = data[os.write(self._fd, data) :]
        return len(text)

    def flush(self):
        if self._fd is None:
            self._original.flush()

    def fileno(self):
        return self._original.fileno()

    def isatty(self):
        return self._original.isatty()

    def writable(self):
        return True

    @property
    def encoding(self):
        return getattr(self._original, "encoding", None)

    @property
    def errors(self):
        return getattr(self._original, "errors", None)

    def __getattr__(self, name):
        return getattr(self._original, name)


def _stream_fd(stream):
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


@contextlib.contextmanager
def native_stderr_held():
    """Sends what native code writes to fd 2 inside the block to a
    temporary file, dropped at the end unless the block raised (or called
    `held.show()`), when it is written to stderr after all. `sys.stderr`
    (when it writes to fd 2) goes on reaching the console meanwhile."""
    held = _Held()
    try:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        saved = os.dup(2)
    except OSError:  # No stderr to hold back.
        yield held
        return
    original = sys.stderr
    passthrough = None
    if original is not None and _stream_fd(original) == 2:
        passthrough = _Passthrough(original, saved)
        sys.stderr = passthrough
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield held
        except BaseException:
            held.shown = True
            raise
        finally:
            os.dup2(saved, 2)
            if passthrough is not None:
                passthrough.release()
                if sys.stderr is passthrough:
                    sys.stderr = original
            if held.shown:
                sink.seek(0)
                data = sink.read()
                while data:
                    data = data[os.write(saved, data) :]
            os.close(saved)
