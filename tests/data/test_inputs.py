"""`open_input` reads every kind of data the same way, and refuses bad structure."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from kdpemb.datasets import UserImages, inputs
from tests.data.elements import Elements, batches

N = 7


def arrays(n=N):
    images = np.arange(n * 4, dtype=np.uint8).reshape(n, 2, 2, 1)
    return images, np.arange(n) % 3, np.arange(n) + 10


def read(data, **kwargs):
    """The whole fields of `data`, read batch by batch."""
    source = inputs.open_input(data, inputs.FIELDS, **kwargs)
    read_batches = list(source.batches())
    present = [f for f in inputs.FIELDS if getattr(read_batches[0], f) is not None]
    return source, {
        f: np.concatenate([getattr(b, f) for b in read_batches]) for f in present
    }


def every_kind(images, labels, user_ids):
    parts = (images, labels, user_ids)
    return {
        "tuple": parts,
        "dict": dict(images=images, labels=labels, user_ids=user_ids),
        "user-images": UserImages(*parts),
        "tf-data": tf.data.Dataset.from_tensor_slices(parts).batch(3),
        "tf-data-dicts": tf.data.Dataset.from_tensor_slices(
            dict(images=images, labels=labels, user_ids=user_ids)
        ).batch(2),
        "pydataset": Elements(batches(*parts)),
        "pydataset-lists": Elements([list(b) for b in batches(*parts)]),
    }


@pytest.mark.parametrize("kind", list(every_kind(*arrays())))
def test_every_kind_of_data_gives_the_same_fields_in_order(kind):
    images, labels, user_ids = arrays()
    data = every_kind(images, labels, user_ids)[kind]
    source, fields = read(data, required=3, batch_size=2)
    assert source.is_stream == kind.startswith(("tf-data", "pydataset"))
    np.testing.assert_array_equal(fields["images"], images)
    np.testing.assert_array_equal(fields["labels"], labels)
    np.testing.assert_array_equal(fields["user_ids"], user_ids)
    whole = source.arrays()
    np.testing.assert_array_equal(whole.images, images)
    np.testing.assert_array_equal(whole.user_ids, user_ids)


def test_arrays_are_cut_into_batches_and_a_lazy_array_is_kept():
    images, labels, _ = arrays()
    source = inputs.open_input((images, labels), batch_size=3)
    assert [len(b.images) for b in source.batches()] == [3, 3, 1]
    assert [b.where for b in source.batches(5)] == ["images[0:5]", "images[5:7]"]
    assert source.arrays().images is images  # Not copied or materialised.
    assert source.num_examples == N and source.num_batches == 3


def test_optional_fields_follow_the_data_and_an_object_gives_the_required_ones():
    images, labels, user_ids = arrays()
    assert inputs.open_input(images).fields == ("images",)
    assert inputs.open_input((images, labels)).fields == ("images", "labels")
    data = UserImages(images, labels, user_ids)
    assert inputs.open_input(data).fields == ("images",)
    assert inputs.open_input(data, required=2).fields == ("images", "labels")
    dataset = tf.data.Dataset.from_tensor_slices(images).batch(3)
    assert inputs.open_input(dataset).fields == ("images",)
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).batch(3)
    assert inputs.open_input(dataset).fields == ("images", "labels")


def test_extra_items_are_refused_or_ignored_as_asked():
    parts = arrays()
    dataset = tf.data.Dataset.from_tensor_slices(parts).batch(3)
    with pytest.raises(ValueError, match=r"must be images or \(images, labels\).*Drop"):
        list(inputs.open_input(dataset).batches())
    source = inputs.open_input(dataset, required=2, ignore_extra=True)
    labels = np.concatenate([b.labels for b in source.batches()])
    np.testing.assert_array_equal(labels, parts[1])
    with pytest.raises(ValueError, match=r"data must be \(images, labels, \.\.\.\)"):
        inputs.open_input(parts[0], required=2, ignore_extra=True)


def test_single_examples_are_read_as_batches_of_one_only_when_allowed():
    images, labels, user_ids = arrays()
    single = tf.data.Dataset.from_tensor_slices((images, labels, user_ids))
    source, fields = read(single, required=3, single_examples=True)
    np.testing.assert_array_equal(fields["labels"], labels)
    assert {len(b.images) for b in source.batches()} == {1}
    with pytest.raises(ValueError, match="single examples; batch it first"):
        list(inputs.open_input(single, inputs.FIELDS).batches())


def test_a_dict_without_a_required_key_names_it():
    images, labels, _ = arrays()
    dataset = tf.data.Dataset.from_tensor_slices(dict(image=images, label=labels))
    with pytest.raises(ValueError, match=r"element 0 .* without key 'images'.*map"):
        list(inputs.open_input(dataset.batch(3)).batches())
    with pytest.raises(ValueError, match="dict without key 'labels'"):
        inputs.open_input(dict(images=images), required=2)


def test_elements_of_changing_structure_or_row_counts_are_refused():
    images, labels, _ = arrays()
    changing = Elements([(images[:3], labels[:3]), images[3:]])
    with pytest.raises(ValueError, match="element 1 of the PyDataset holds images"):
        list(inputs.open_input(changing).batches())
    short = Elements([(images[:3], labels[:2])])
    with pytest.raises(ValueError, match=r"labels must have shape \(3, \.\.\.\)"):
        list(inputs.open_input(short).batches())
    with pytest.raises(ValueError, match=r"user_ids must have shape \(7, \.\.\.\)"):
        inputs.open_input((images, labels, labels[:-1]), inputs.FIELDS)


def test_inconsistent_image_shapes_are_refused_when_read_whole():
    mixed = Elements([np.zeros((2, 4, 4, 1)), np.zeros((2, 5, 5, 1))])
    with pytest.raises(ValueError, match=r"inconsistent shapes.*element 1"):
        inputs.open_input(mixed).arrays()
    with pytest.raises(ValueError, match="inconsistent shapes"):
        inputs.open_input([np.zeros((4, 4, 1)), np.zeros((5, 5, 1))])


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        (
            tf.data.Dataset.from_tensor_slices(np.zeros((2, 3))).repeat(),
            ValueError,
            "repeats forever",
        ),
        (np.zeros((0, 2, 2, 1)), ValueError, "holds no images"),
        (Elements([]), ValueError, "yielded no images"),
        (np.zeros(3), ValueError, r"at least \(N, \.\.\.\), got shape \(3,\)"),
        (np.full((2, 3), "a"), ValueError, "Images must be numbers"),
        (Elements([np.full((2, 3), "a")]), ValueError, "Images must be numbers"),
        (iter([np.zeros((2, 3))]), TypeError, "data must be"),
    ],
    ids=["infinite", "empty", "empty-stream", "1-d", "text", "text-stream", "gen"],
)
def test_bad_data_is_refused_with_a_message(data, error, message):
    with pytest.raises(error, match=message):
        list(inputs.open_input(data).batches())


def test_an_infinite_pydataset_is_refused():
    class Endless(keras.utils.PyDataset):
        num_batches = None

        def __getitem__(self, index):
            return np.zeros((2, 3))

    with pytest.raises(ValueError, match="infinite"):
        inputs.open_input(Endless())


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True, "8"])
def test_batch_size_must_be_a_positive_int(batch_size):
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        inputs.open_input(arrays()[0], batch_size=batch_size)


def test_telling_the_kind_of_data_imports_no_tensorflow():
    code = (
        "import sys, keras, numpy as np\n"
        "from kdpemb.datasets import inputs\n"
        "class Two(keras.utils.PyDataset):\n"
        "    def __len__(self): return 2\n"
        "    def __getitem__(self, i): return np.zeros((3, 2))\n"
        "for data in (np.zeros((3, 2)), (np.zeros((3, 2)), np.arange(3)), Two()):\n"
        "    list(inputs.open_input(data).batches())\n"
        "print('tensorflow' in sys.modules, inputs.is_dataset(Two()))\n"
    )
    env = dict(os.environ, KERAS_BACKEND="jax")
    # No timeout: the child reads three tiny inputs and exits.
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["False", "True"]


def test_fixed_size_sampling_draws_exactly_b_distinct_rows_padded_to_a_multiple():
    from kdpemb.data.poisson_batches import PoissonIndices

    batches = PoissonIndices(50, batch_size=12, steps=30, seed=0, sampling="fixed",
                             multiple_of=5)  # fmt: skip
    seen = np.zeros(50)
    for step in range(30):
        indices, mask = batches[step]
        assert len(indices) == 15 and mask.sum() == 12  # 12 padded to 3 × 5.
        chosen = indices[mask == 1]
        assert len(set(chosen.tolist())) == 12
        seen[chosen] += 1
    assert seen.min() > 0  # Uniform over all rows, not a fixed subset.
    poisson = PoissonIndices(1000, batch_size=50, steps=5, seed=0, multiple_of=64)
    for step in range(5):
        indices, mask = poisson[step]
        assert len(indices) % 64 == 0 and len(indices) >= mask.sum()
