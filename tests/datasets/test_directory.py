import numpy as np
import pytest
from PIL import Image

from kdpemb.datasets import UserImages
from kdpemb.datasets.directory import from_directory


def save(path, value, size=(6, 4), mode="RGB"):
    """A flat image of `value` with `size` = (width, height), as Pillow has it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value).save(path)
    return path


def gray(v):
    return (v, v, v)


@pytest.fixture
def users_tree(tmp_path):
    """ann: cat (2), dog (1); bob: cat (1), eel (1). Pixel value = image number."""
    root = tmp_path / "users"
    save(root / "ann" / "cat" / "b.png", gray(20))  # Sorted after a.png.
    save(root / "ann" / "cat" / "a.png", gray(10))
    save(root / "ann" / "dog" / "x.png", gray(30))
    save(root / "bob" / "eel" / "1.png", gray(50))
    save(root / "bob" / "cat" / "1.png", gray(40))
    return root


def test_users_layout_gives_labels_user_ids_and_names(users_tree):
    data = from_directory(users_tree, layout="users")
    assert isinstance(data, UserImages)
    assert data.class_names == ("cat", "dog", "eel")
    assert data.user_names == ("ann", "bob")
    assert data.images[:, 0, 0, 0].tolist() == [10, 20, 30, 40, 50]
    assert data.labels.tolist() == [0, 0, 1, 0, 2]
    assert data.user_ids.tolist() == [0, 0, 0, 1, 1]
    assert data.labels.dtype == data.user_ids.dtype == np.int64
    assert data.images.dtype == np.uint8
    assert data.images.shape == (5, 4, 6, 3)


def test_the_same_identity_folder_under_two_users_is_one_label(users_tree):
    data = from_directory(users_tree)
    cats = data.labels[data.images[:, 0, 0, 0] == 10][0]
    assert data.labels[data.images[:, 0, 0, 0] == 40][0] == cats
    assert data.num_classes == 3


def test_identities_layout_makes_each_identity_its_own_user(tmp_path):
    save(tmp_path / "zed" / "1.jpg", gray(0))
    save(tmp_path / "amy" / "1.png", gray(0))
    save(tmp_path / "amy" / "2.png", gray(0))
    data = from_directory(tmp_path, layout="identities")
    assert data.class_names == data.user_names == ("amy", "zed")
    assert data.labels.tolist() == [0, 0, 1]
    assert data.user_ids.tolist() == [0, 0, 1]


def test_auto_detects_each_layout(users_tree, tmp_path):
    identities = tmp_path / "ids"
    save(identities / "a" / "1.png", gray(1))
    save(identities / "b" / "1.png", gray(2))
    auto = from_directory(identities)
    assert auto.user_names == ("a", "b")  # identities layout: users = identities.
    auto = from_directory(users_tree)
    explicit = from_directory(users_tree, layout="users")
    assert auto.user_names == explicit.user_names == ("ann", "bob")
    np.testing.assert_array_equal(auto.labels, explicit.labels)


def test_auto_rejects_a_mix_of_layouts(tmp_path):
    save(tmp_path / "ann" / "cat" / "1.png", gray(1))
    save(tmp_path / "dog" / "1.png", gray(1))
    with pytest.raises(ValueError, match=r"mixes layouts.*dog.*ann"):
        from_directory(tmp_path)


def test_auto_rejects_a_folder_with_both_images_and_subfolders(tmp_path):
    save(tmp_path / "ann" / "cat" / "1.png", gray(1))
    save(tmp_path / "ann" / "1.png", gray(1))
    with pytest.raises(ValueError, match=r"ann holds both image files and subfolders"):
        from_directory(tmp_path)


def test_grayscale_gives_one_channel_and_rgb_three(tmp_path):
    save(tmp_path / "a" / "color.png", (255, 0, 0))
    save(tmp_path / "a" / "gray.png", 77, mode="L")
    rgb = from_directory(tmp_path, color_mode="rgb")
    grayscale = from_directory(tmp_path, color_mode="grayscale")
    assert rgb.images.shape == (2, 4, 6, 3)
    assert grayscale.images.shape == (2, 4, 6, 1)
    assert rgb.images[0, 0, 0].tolist() == [255, 0, 0]
    assert rgb.images[1, 0, 0].tolist() == [77, 77, 77]
    assert grayscale.images[0, 0, 0, 0] == 76  # ITU-R 601 luma of pure red.
    assert grayscale.images[1, 0, 0, 0] == 77


def test_image_size_resizes_every_image_to_height_by_width(tmp_path):
    save(tmp_path / "a" / "1.png", gray(9), size=(10, 20))
    save(tmp_path / "b" / "1.jpeg", gray(200), size=(3, 3))
    data = from_directory(tmp_path, image_size=(5, 7))
    assert data.images.shape == (2, 5, 7, 3)
    assert data.images[0].min() == data.images[0].max() == 9  # Flat stays flat.


def test_different_sizes_without_image_size_name_both_files(tmp_path):
    save(tmp_path / "a" / "1.png", gray(0), size=(6, 4))
    save(tmp_path / "b" / "2.png", gray(0), size=(8, 4))
    with pytest.raises(ValueError) as error:
        from_directory(tmp_path)
    message = str(error.value)
    assert str(tmp_path / "a" / "1.png") in message
    assert str(tmp_path / "b" / "2.png") in message
    assert "4x6" in message and "4x8" in message
    assert "image_size=" in message


def test_empty_user_folders_are_dropped_with_one_counting_warning(users_tree):
    (users_tree / "cyd").mkdir()
    (users_tree / "dan" / "cat").mkdir(parents=True)
    with pytest.warns(UserWarning) as record:
        data = from_directory(users_tree)
    assert len(record) == 1
    assert "2 of 4 user folders" in str(record[0].message)
    assert "2 remain" in str(record[0].message)
    assert data.user_names == ("ann", "bob")
    assert data.user_ids.max() == 1


def test_empty_identity_folders_are_dropped_with_one_counting_warning(tmp_path):
    save(tmp_path / "a" / "1.png", gray(0))
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    with pytest.warns(UserWarning, match="2 of 3 identity folders") as record:
        data = from_directory(tmp_path, layout="identities")
    assert len(record) == 1
    assert data.class_names == ("a",)


def test_undecodable_image_is_a_value_error_naming_the_file(tmp_path):
    save(tmp_path / "a" / "1.png", gray(0))
    bad = tmp_path / "a" / "2.jpg"
    bad.write_bytes(b"this is not a jpeg")
    with pytest.raises(ValueError, match="Cannot decode") as error:
        from_directory(tmp_path)
    assert str(bad) in str(error.value)


def test_hidden_and_non_image_files_are_ignored(tmp_path):
    save(tmp_path / "a" / "1.png", gray(0))
    save(tmp_path / "a" / ".hidden.png", gray(0), size=(9, 9))
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    save(tmp_path / ".cache" / "x" / "1.png", gray(0))
    (tmp_path / "README.txt").write_text("hello")
    data = from_directory(tmp_path)
    assert len(data) == 1
    assert data.class_names == ("a",)


def test_upper_case_and_jpeg_extensions_are_read(tmp_path):
    save(tmp_path / "a" / "1.JPG", gray(0))
    save(tmp_path / "a" / "2.jpeg", gray(0))
    save(tmp_path / "a" / "3.PNG", gray(0))
    assert len(from_directory(tmp_path)) == 3


def test_no_images_is_a_value_error_naming_the_path(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="No image files") as error:
        from_directory(tmp_path)
    assert str(tmp_path) in str(error.value)


def test_images_directly_in_the_root_are_an_error(tmp_path):
    save(tmp_path / "1.png", gray(0))
    with pytest.raises(ValueError, match=r"holds image files directly.*1\.png"):
        from_directory(tmp_path)


def test_missing_path_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        from_directory(tmp_path / "nope")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"color_mode": "rgba"}, "color_mode"),
        ({"layout": "flat"}, "layout"),
        ({"image_size": 32}, r"image_size.*\(64, 64\)"),
        ({"image_size": (0, 4)}, "image_size"),
    ],
)
def test_invalid_options_raise(tmp_path, kwargs, match):
    save(tmp_path / "a" / "1.png", gray(0))
    with pytest.raises(ValueError, match=match):
        from_directory(tmp_path, **kwargs)
