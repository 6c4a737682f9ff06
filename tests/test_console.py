"""A quiet console: `import kdpemb` and a fit print nothing on stderr but
kdpemb's own lines, and `KDPEMB_BACKEND_LOGS=1` brings the backends' back.

The backends' lines come at their start (TensorFlow's absl, oneDNN and CUDA
probing lines), from TensorFlow's vectoriser (while-loop notes), from its
retracing detector, and at exit (an iterator finalised too late), so the
check is a child process run to its end, once per backend.
"""

import gc
import logging
import os
import re
import subprocess
import sys

import keras
import pytest

from kdpemb import _console as console
from kdpemb import errors

BACKEND = keras.backend.backend()

# A DPModel stopped by its budget mid-epoch (an iterator left to the exit),
# a FedEmbModel training clients at once (TensorFlow's vectoriser), and six
# one-layer models (TensorFlow's retracing detector counts their functions).
FITS = """
import numpy as np
import kdpemb
import keras
from kdpemb.callbacks import PrivacyBudget

rng = np.random.default_rng(0)
x = rng.normal(size=(32, 4, 4, 1)).astype("float32")
y = rng.integers(0, 3, 32)
net = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Conv2D(2, 3),
                        keras.layers.Flatten(), keras.layers.Dense(3)])
model = kdpemb.DPModel(net, clip_norm=1.0, noise_multiplier=0.7,
                       gradient_method="vectorized")
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
budget = PrivacyBudget(delta=1e-3, target_epsilon=3.0, verbose=0)
model.fit(x, y, batch_size=8, epochs=2, callbacks=[budget], verbose=0)
assert model.stop_training, "the budget stops the fit within an epoch"

if keras.backend.backend() == "tensorflow":
    from kdpemb.data import VirtualClients
    from kdpemb.datasets import synthetic_identities

    data = synthetic_identities(8, 2, image_size=8, seed=0)
    clients = VirtualClients(data, clients_per_round=2, users_per_client=2,
                             num_clients=4, batch_size=2, local_steps=1,
                             rounds_per_epoch=1, workers=1)
    backbone = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(2, 3),
                                 keras.layers.Flatten()])
    fedemb = kdpemb.FedEmbModel(backbone, schedule=clients.schedule, clip_norm=1.0,
                                noise_multiplier=1.0, client_parallelism=2)
    fedemb.compile()
    fedemb.fit(clients, epochs=1, verbose=0)

for _ in range(6):
    layer = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    layer.predict_on_batch(np.ones((1, 2), "float32"))
print("fitted")
"""

KDPEMB_WARNING = re.compile(r"^\S.*:\d+: (\w+): ")


def run_child(code, backend=BACKEND, **env_overrides):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CPP_MIN_LOG_LEVEL", console.VARIABLE)
    }
    env.update(KERAS_BACKEND=backend, **env_overrides)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )  # No timeout: the child fits tiny models and exits; it waits on nothing.
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def foreign_lines(stderr):
    """The lines of `stderr` that are not kdpemb's own warnings (a warning's
    first line names its category; the source line after it is indented)."""
    foreign, in_warning = [], False
    for line in stderr.splitlines():
        match = KDPEMB_WARNING.match(line)
        if match:
            in_warning = match.group(1) in errors.__all__
            if in_warning:
                continue
        elif in_warning and line.startswith(" "):
            continue
        in_warning = False
        if line.strip():
            foreign.append(line)
    return foreign


def test_kdpembs_own_warnings_are_the_only_lines_let_through():
    stderr = (
        "/home/me/train.py:12: SmallPopulationWarning: only 16 examples\n"
        "  model.fit(x, y)\n"
        "WARNING: All log messages before absl::InitializeLog() is called\n"
        "/x/site-packages/keras/trainer.py:3: UserWarning: not kdpemb's\n"
        "  warnings.warn(...)\n"
    )
    assert foreign_lines(stderr) == stderr.splitlines()[2:]


def test_an_import_and_fits_print_nothing_on_stderr_but_kdpembs_own_lines():
    # Under this run's backend (`make test` runs the suite under each one).
    result = run_child(FITS)
    assert result.stdout.strip() == "fitted"
    assert foreign_lines(result.stderr) == [], result.stderr[-3000:]


SETTINGS = """
import logging, os, sys
import kdpemb
finders = [type(f).__name__ for f in sys.meta_path]
filters = [type(f).__name__ for f in logging.getLogger("tensorflow").filters]
print(os.environ.get("TF_CPP_MIN_LOG_LEVEL"), "_QuietTensorFlowImport" in finders,
      filters)
"""


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "2 True ['_KerasStepRetracing']"),
        ({console.VARIABLE: "1"}, "None False []"),  # The documented switch.
        ({console.VARIABLE: "0"}, "2 True ['_KerasStepRetracing']"),
        ({"TF_CPP_MIN_LOG_LEVEL": "0"}, "0 True ['_KerasStepRetracing']"),
    ],
)
def test_the_switch_leaves_the_backends_as_they_are(env, expected):
    # Before TensorFlow starts (which it need not, to tell).
    assert run_child(SETTINGS, **env).stdout.strip() == expected


def test_held_native_output_is_dropped_on_success_and_shown_on_error(capfd):
    with console.native_stderr_held():
        os.write(2, b"native start-up line\n")
    with pytest.raises(ImportError), console.native_stderr_held():
        os.write(2, b"native reason of the failure\n")
        raise ImportError("no backend")
    err = capfd.readouterr().err
    assert "native start-up line" not in err
    assert "native reason of the failure" in err


def record(pathname, level, message):
    return logging.LogRecord("tensorflow", level, pathname, 1, message, None, None)


def test_the_vectorisers_notes_are_dropped_inside_kdpembs_block_only():
    pfor = "/site-packages/tensorflow/python/ops/parallel_for/pfor.py"
    note = record(pfor, logging.WARNING, "Conv2DBackpropFilter uses a while_loop.")
    error = record(pfor, logging.ERROR, "Cannot convert the graph")
    other = record("/site-packages/tensorflow/python/ops/nn.py", logging.WARNING, "x")
    tf_logger = logging.getLogger("tensorflow")
    with console.vectorizer_logs_quieted():
        assert [tf_logger.filter(r) for r in (note, error, other)] == [0, 1, 1]
    with console.vectorizer_logs_quieted(keep_errors=False):
        assert [tf_logger.filter(r) for r in (note, error, other)] == [0, 0, 1]
    assert tf_logger.filter(note)  # The user's own vectorised maps: as TF logs.


def test_only_the_retracing_warning_about_keras_step_functions_is_dropped():
    def warning(function):
        return record(
            "/tensorflow/python/eager/polymorphic_function/polymorphic_function.py",
            logging.WARNING,
            f"5 out of the last 8 calls to <function {function} at 0x7f> "
            "triggered tf.function retracing. Tracing is expensive",
        )

    quiet = console._KerasStepRetracing()
    keras_step = "TensorFlowTrainer._make_function.<locals>.multi_step_on_iterator"
    assert not quiet.filter(warning(keras_step))
    assert quiet.filter(warning("my_step"))


def test_the_exit_collection_frees_the_iterator_of_a_fit_stopped_early():
    from keras.src.trainers.epoch_iterator import EpochIterator

    import kdpemb
    from kdpemb.callbacks import PrivacyBudget

    def alive():
        return sum(isinstance(o, EpochIterator) for o in gc.get_objects())

    gc.collect()
    before = alive()
    toy = kdpemb.testing.ToyDPRegressor(
        num_examples=16, num_features=2, noise_multiplier=1.0, sampling_probability=0.5
    )
    toy.compile(optimizer="sgd")
    budget = PrivacyBudget(delta=1e-3, target_epsilon=3.0, verbose=0)
    data = kdpemb.testing.toy_regression_data(16, 2, steps_per_epoch=2)
    toy.fit(data, epochs=20, callbacks=[budget], verbose=0)
    assert toy.stop_training  # Within the first epoch.
    # Stopped mid-epoch, the iterator's generator is suspended in a cycle:
    # freed only by a collection (on TensorFlow its finaliser runs Python,
    # which at interpreter teardown is too late).
    assert alive() > before
    console._collect_before_exit()
    assert alive() == before


def test_a_logged_extraction_says_what_it_runs_before_it_ends(capsys):
    import numpy as np

    from kdpemb.features import extract

    backbone = keras.Sequential([keras.Input((2, 2, 1)), keras.layers.Flatten()])
    extract(backbone, np.ones((3, 2, 2, 1)), batch_size=2, verbose=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Extracting the features of 3 images…"
    assert len(lines) == 2 and lines[1].startswith("2/2")  # Keras' end line.
