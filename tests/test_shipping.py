"""Models to ship load where kdpemb cannot be imported; `import kdpemb`
alone lets `keras.saving.load_model` read every kdpemb model.

Each check runs in a fresh Python process (one per test, under the suite's
backend), since the point is what that process has imported.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import keras
import numpy as np

import kdpemb
from kdpemb.models import LastLayerDPClassifier

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "saved_models"

# The child's first lines: any import of kdpemb fails, as where it is not
# installed (kdpemb is installed in editable mode, so a path is not enough).
REFUSE_KDPEMB = """
import sys

class RefuseKdpemb:
    def find_spec(self, name, path=None, target=None):
        if name == "kdpemb" or name.startswith("kdpemb."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, RefuseKdpemb())
"""

LOAD_WITHOUT_KDPEMB = """
import json
import keras
import numpy as np
try:
    import kdpemb
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("kdpemb was imported")
directory = sys.argv[1]
images = np.load(f"{directory}/images.npy")
outputs = {}
for name in ("classifier", "backbone"):
    model = keras.saving.load_model(f"{directory}/{name}.keras")
    np.save(f"{directory}/{name}_out.npy", model.predict(images, verbose=0))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "kdpemb")))
"""


def run_child(code, *args):
    env = {**os.environ, "KERAS_BACKEND": keras.backend.backend()}
    result = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )  # No timeout: the child loads small files, predicts and exits.
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_shipped_classifier_and_backbone_predict_where_kdpemb_is_not_installed(
    tmp_path,
):
    # The FedEmb backbone as users ship it (`model.backbone.save`), and the
    # last-layer head stacked on it (the docs' model to ship).
    backbone = keras.saving.load_model(FIXTURES / "fedemb.keras").backbone
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (30, *backbone.input_shape[1:])).astype("float32")
    features = backbone.predict(images, verbose=0)
    norms = np.linalg.norm(features, axis=1)
    head = LastLayerDPClassifier(
        3, "dp-ls", feature_clip_norm=float(np.median(norms)), noise_multiplier=1.0
    )  # Half of the rows are clipped.
    head.fit(features, np.arange(30) % 3, verbose=0)
    classifier = head.stack_on(backbone)
    expected = classifier.predict(images, verbose=0)
    # The shipped model computes what the classifier does on the features.
    np.testing.assert_allclose(
        expected, head.predict(features, verbose=0), rtol=1e-5, atol=1e-5
    )
    classifier.save(tmp_path / "classifier.keras")
    backbone.save(tmp_path / "backbone.keras")
    np.save(tmp_path / "images.npy", images)

    loaded = run_child(REFUSE_KDPEMB + LOAD_WITHOUT_KDPEMB, tmp_path)

    assert loaded == []
    np.testing.assert_allclose(
        np.load(tmp_path / "classifier_out.npy"), expected, rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        np.load(tmp_path / "backbone_out.npy"), features, rtol=1e-5, atol=1e-5
    )


def registered_classes():
    """ "package>Class" of every class kdpemb registers with Keras, read
    from the source, so that a new one is checked without being listed."""
    pattern = re.compile(
        r"@keras\.saving\.register_keras_serializable\(package=\"([\w.]+)\"\)"
        r"\s*\nclass (\w+)"
    )
    names = set()
    for path in pathlib.Path(kdpemb.__file__).parent.rglob("*.py"):
        names |= {f"{p}>{c}" for p, c in pattern.findall(path.read_text())}
    return sorted(names)


# Keras imported after kdpemb, by the user: kdpemb's classes are registered
# once Keras is in (nothing of kdpemb.models before).
AFTER_IMPORT_KDPEMB = """
import json, sys
import kdpemb
before = "kdpemb.models" in sys.modules
import keras
names, files = json.loads(sys.argv[1]), json.loads(sys.argv[2])
missing = [n for n in names if keras.saving.get_registered_object(n) is None]
loaded = [type(keras.saving.load_model(f)).__name__ for f in files]
print(json.dumps([before, missing, loaded]))
"""

# Keras imported by a kdpemb module while it is being imported.
AFTER_A_KDPEMB_MODULE = """
import json, sys
import kdpemb.callbacks
import keras
names, files = json.loads(sys.argv[1]), json.loads(sys.argv[2])
missing = [n for n in names if keras.saving.get_registered_object(n) is None]
loaded = [type(keras.saving.load_model(f)).__name__ for f in files]
print(json.dumps([False, missing, loaded]))
"""


def check_registration(code, files):
    names = registered_classes()
    assert {"kdpemb>DPModel", "kdpemb>ClipFeatures", "kdpemb>FedEmbModel"} <= set(names)
    before, missing, loaded = run_child(
        code, json.dumps(names), json.dumps([str(FIXTURES / f) for f in files])
    )
    assert not before
    assert missing == []
    return loaded


def test_import_kdpemb_alone_lets_keras_load_every_kdpemb_model():
    files = [
        "dp_model_target_epsilon.keras",
        "fedemb.keras",
        "last_layer_dp-ls.keras",
        "toy_dp_regressor.keras",
    ]
    loaded = check_registration(AFTER_IMPORT_KDPEMB, files)
    assert loaded == [
        "DPModel", "FedEmbModel", "LastLayerDPClassifier", "ToyDPRegressor",
    ]  # fmt: skip


def test_keras_imported_by_a_kdpemb_module_registers_kdpemb_too():
    loaded = check_registration(AFTER_A_KDPEMB_MODULE, ["last_layer_dp-sgd.keras"])
    assert loaded == ["LastLayerDPClassifier"]
