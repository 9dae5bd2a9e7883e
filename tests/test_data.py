"""jaxring.data on real JPEG files written by write_image_folder: layouts, labels against the
pixels, determinism, sharding, resume, corrupt files, errors, eval coverage."""
import colorsys
import math
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest
from PIL import Image

from jaxring.data import (CorruptImageError, ImageFolder, ImageLoader, SyntheticImages,
                          load_image, prefetch_to_device, random_resized_crop_box,
                          write_image_folder)

NUM_CLASSES = 10
TRAIN_PER_CLASS = 6
VAL_PER_CLASS = 4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  path = tmp_path_factory.mktemp("imagenet")
  write_image_folder(path, num_classes=NUM_CLASSES, train_per_class=TRAIN_PER_CLASS,
                     val_per_class=VAL_PER_CLASS, image_size=40, seed=0, val_layout="folders")
  return path


@pytest.fixture(scope="module")
def flat_root(tmp_path_factory):
  path = tmp_path_factory.mktemp("imagenet_flat")
  wnids = write_image_folder(path, num_classes=NUM_CLASSES, train_per_class=1,
                             val_per_class=VAL_PER_CLASS, image_size=40, seed=1, val_layout="flat")
  return path, wnids


def loader(ds, batch, **kw):
  kw.setdefault("image_size", 32)
  kw.setdefault("process_index", 0)
  kw.setdefault("process_count", 1)
  kw.setdefault("num_workers", 2)
  return ImageLoader(ds, batch, **kw)


def take(it, n):
  return [next(it) for _ in range(n)]


def dominant_hue(image: np.ndarray) -> float:
  """The most frequent hue among saturated, bright pixels (a float64 reference, not the code)."""
  x = image.reshape(-1, 3).astype(np.float64) / 255
  hsv = np.array([colorsys.rgb_to_hsv(*p) for p in x])
  keep = (hsv[:, 1] > 0.45) & (hsv[:, 2] > 0.35)
  counts = np.bincount((hsv[keep, 0] * 40).astype(int) % 40, minlength=40)
  counts = counts + np.roll(counts, 1) + np.roll(counts, -1)  # tolerate a bin edge
  return (np.argmax(counts) + 0.5) / 40


def hue_class(image: np.ndarray) -> int:
  # write_image_folder's documented rule: with <= 12 classes, class c has hue c / num_classes
  return int(round(dominant_hue(image) * NUM_CLASSES)) % NUM_CLASSES


# --- layout -------------------------------------------------------------------------------------

def test_train_layout_labels_follow_folders(root):
  ds = ImageFolder(root, "train", num_classes=NUM_CLASSES)
  assert ds.classes == [f"n{c:08d}" for c in range(NUM_CLASSES)]
  assert len(ds) == NUM_CLASSES * TRAIN_PER_CLASS and ds.num_classes == NUM_CLASSES
  assert ds.labels.dtype == np.int32
  for path, label in zip(ds.paths, ds.labels):
    assert pathlib.Path(path).parent.name == ds.classes[label]


def test_extensions_any_case_and_png(root, tmp_path):
  shutil.copytree(root / "train", tmp_path / "train")
  folder = tmp_path / "train" / "n00000001"
  first = sorted(folder.iterdir())[0]
  first.rename(folder / "a.jpg")
  Image.open(folder / "a.jpg").save(folder / "b.PNG")
  (folder / "notes.txt").write_text("not an image")
  ds = ImageFolder(tmp_path, "train")
  names = {os.path.basename(p) for p in ds.paths}
  assert {"a.jpg", "b.PNG"} <= names and "notes.txt" not in names
  assert len(ds) == NUM_CLASSES * TRAIN_PER_CLASS + 1


def test_val_folders_use_train_classes(root):
  val = ImageFolder(root, "val")
  assert val.classes == ImageFolder(root, "train").classes
  assert len(val) == NUM_CLASSES * VAL_PER_CLASS
  for path, label in zip(val.paths, val.labels):
    assert pathlib.Path(path).parent.name == val.classes[label]


def test_val_flat_with_text_and_kaggle_labels(flat_root, tmp_path):
  path, wnids = flat_root
  text = ImageFolder(path, "val")
  assert len(text) == NUM_CLASSES * VAL_PER_CLASS and text.classes == wnids
  written = dict(line.split() for line in (path / "val_labels.txt").read_text().splitlines())
  for p, label in zip(text.paths, text.labels):
    assert wnids[label] == written[os.path.basename(p)]
  assert len(set(text.labels.tolist())) == NUM_CLASSES

  # the same images with Kaggle's LOC_val_solution.csv (ImageId without extension, boxes after
  # the wnid) three folders above the split's root, as in ILSVRC/Data/CLS-LOC
  kaggle = tmp_path / "ILSVRC" / "Data" / "CLS-LOC"
  shutil.copytree(path / "val", kaggle / "val")
  rows = [f"{name[:-5]},{wnid} 10 20 30 40 {wnid} 1 2 3 4" for name, wnid in written.items()]
  (tmp_path / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "\n".join(rows))
  csv = ImageFolder(kaggle, "val")
  assert [os.path.basename(p) for p in csv.paths] == [os.path.basename(p) for p in text.paths]
  np.testing.assert_array_equal(csv.labels, text.labels)


def test_labels_match_the_pixels(flat_root):
  path, _ = flat_root
  ds = ImageFolder(path, "val")  # a shuffled flat layout: labels come from the labels file
  batches = list(loader(ds, 16, train=False, image_size=40, drop_remainder=False, num_epochs=1))
  images = np.concatenate([b["image"][b["mask"]] for b in batches])
  labels = np.concatenate([b["label"][b["mask"]] for b in batches])
  assert len(labels) == len(ds)
  agree = np.mean([hue_class(x) == y for x, y in zip(images, labels)])
  assert agree >= 0.9, agree  # chance: 0.1


# --- batches ------------------------------------------------------------------------------------

def test_shapes_dtypes_and_eval_mask(root):
  ds = ImageFolder(root, "train")
  b = next(loader(ds, 16, train=True, image_size=24))
  assert b.keys() == {"image", "label"}
  assert b["image"].shape == (16, 24, 24, 3) and b["image"].dtype == np.uint8
  assert b["label"].shape == (16,) and b["label"].dtype == np.int32
  e = next(loader(ds, 16, train=False, drop_remainder=False, process_index=1, process_count=2))
  assert e["image"].shape == (8, 32, 32, 3) and e["mask"].dtype == np.bool_


def test_augmentation_deterministic_and_independent_of_workers(root):
  ds = ImageFolder(root, "train")
  a = take(loader(ds, 16, train=True, seed=3, num_workers=1, prefetch=0), 3)
  b = take(loader(ds, 16, train=True, seed=3, num_workers=3, prefetch=4), 3)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["image"], y["image"])
    np.testing.assert_array_equal(x["label"], y["label"])
  c = next(loader(ds, 16, train=True, seed=4))
  assert not np.array_equal(a[0]["image"], c["image"])


def test_augmentation_differs_across_epochs(root):
  ds = ImageFolder(root, "train")
  it = loader(ds, len(ds), train=True)  # one batch per epoch: every example once
  e0, e1 = next(it), next(it)
  i0, i1 = it.example_indices(0, 0), it.example_indices(1, 0)
  assert sorted(i0) == sorted(i1) == list(range(len(ds))) and not np.array_equal(i0, i1)
  np.testing.assert_array_equal(e0["label"], ds.labels[i0])
  same = e1["image"][np.argsort(i1)] == e0["image"][np.argsort(i0)]
  per_example_equal = same.reshape(len(ds), -1).all(axis=1)
  assert per_example_equal.mean() < 0.1
  # eval is a fixed transform in a fixed order
  ev = loader(ds, 20, train=False)
  first = take(ev, ev.batches_per_epoch + 1)
  np.testing.assert_array_equal(first[0]["image"], first[-1]["image"])


def test_random_resized_crop_box_ranges():
  rng = np.random.default_rng(0)
  for width, height in [(500, 375), (64, 300), (40, 40)]:
    for _ in range(300):
      x, y, w, h = random_resized_crop_box(width, height, rng)
      assert 0 <= x and 0 <= y and x + w <= width and y + h <= height and w > 0 and h > 0
      fallback = (w, h) in [(width, height), (width, round(width / 0.75)),
                            (round(height * 4 / 3), height)]
      if not fallback:
        assert 0.08 * 0.9 <= w * h / (width * height) <= 1.0
        assert 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1


def test_grayscale_and_cmyk_decode_to_rgb(tmp_path):
  Image.new("L", (50, 40), 100).save(tmp_path / "gray.JPEG")
  Image.new("CMYK", (50, 40), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")  # red
  gray = load_image(str(tmp_path / "gray.JPEG"), 16, train=False)
  assert gray.shape == (16, 16, 3) and np.abs(gray.astype(int) - 100).max() <= 2
  red = load_image(str(tmp_path / "cmyk.jpg"), 16, train=True, rng=np.random.default_rng(0))
  assert red.shape == (16, 16, 3) and red[..., 0].min() > 200 and red[..., 1:].max() < 60


def test_draft_decode_matches_full_decode(tmp_path):
  # a large JPEG loaded small goes through libjpeg's 1/8 scaling; compare with a full-size decode
  # and one resampling of the same region (a wrong box mapping would compare different regions)
  yy, xx = np.mgrid[0:600, 0:800]
  pixels = np.stack([xx * 255 // 800, yy * 255 // 600, (xx + yy) % 256], -1).astype(np.uint8)
  Image.fromarray(pixels).save(tmp_path / "big.JPEG", quality=95)
  got = load_image(str(tmp_path / "big.JPEG"), 32, train=False)
  side = 0.875 * 600
  box = ((800 - side) / 2, (600 - side) / 2, (800 + side) / 2, (600 + side) / 2)
  want = np.asarray(Image.open(tmp_path / "big.JPEG").convert("RGB").resize(
      (32, 32), Image.Resampling.BILINEAR, box=box))
  assert np.abs(got[..., :2].astype(int) - want[..., :2]).mean() < 4


# --- sharding, resume, prefetch -----------------------------------------------------------------

def test_process_sharding_splits_each_global_batch(root):
  ds = ImageFolder(root, "train")
  whole = take(loader(ds, 16, train=True, seed=1), 4)
  parts = [take(loader(ds, 16, train=True, seed=1, process_index=p, process_count=2), 4)
           for p in (0, 1)]
  for k in range(4):
    for key in ("image", "label"):
      np.testing.assert_array_equal(
          np.concatenate([parts[0][k][key], parts[1][k][key]]), whole[k][key])
  probe = [loader(ds, 16, train=True, seed=1, process_index=p, process_count=2) for p in (0, 1)]
  for index in range(3):
    a, b = (pr.example_indices(0, index) for pr in probe)
    assert len(set(a) | set(b)) == 16  # no overlap


def test_resume_yields_the_same_batches(root):
  ds = ImageFolder(root, "train")  # 60 images, 3 batches of 16 per epoch: resume crosses epochs
  straight = loader(ds, 16, train=True, seed=2)
  take(straight, 2)
  state = straight.get_state()
  assert state == {"epoch": 0, "index": 2, "seed": 2}
  expected = take(straight, 4)
  resumed = loader(ds, 16, train=True, seed=2, num_workers=1)
  next(resumed)  # some other position and prefetched batches, discarded by set_state
  resumed.set_state(state)
  for x, y in zip(expected, take(resumed, 4)):
    np.testing.assert_array_equal(x["image"], y["image"])
    np.testing.assert_array_equal(x["label"], y["label"])
  assert resumed.get_state() == {"epoch": 2, "index": 0, "seed": 2}
  with pytest.raises(ValueError, match="seed"):
    loader(ds, 16, train=True, seed=5).set_state(state)


def test_prefetch_to_device_values_and_position(root):
  ds = ImageFolder(root, "train")
  host = take(loader(ds, 16, train=True), 3)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  dev = prefetch_to_device(loader(ds, 16, train=True), size=2, sharding=sharding)
  got = take(dev, 2)
  assert dev.get_state()["index"] == 2  # consumed, not prefetched (it has pulled 3 by now)
  assert isinstance(got[0]["image"], jax.Array) and got[0]["image"].sharding == sharding
  for x, y in zip(host, got):
    np.testing.assert_array_equal(np.asarray(y["image"]), x["image"])
  dev.set_state({"epoch": 0, "index": 2, "seed": 0})
  np.testing.assert_array_equal(np.asarray(next(dev)["label"]), host[2]["label"])
  assert dev.batches_per_epoch == 3


def test_synthetic_images_interface():
  whole = SyntheticImages(8, image_size=16, num_classes=5, process_index=0, process_count=1)
  half = SyntheticImages(8, image_size=16, num_classes=5, process_index=1, process_count=2)
  a, b = next(whole), next(half)
  assert a["image"].shape == (8, 16, 16, 3) and a["image"].dtype == np.uint8
  assert b["image"].shape == (4, 16, 16, 3) and b["label"].dtype == np.int32
  np.testing.assert_array_equal(b["label"], a["label"][4:])
  assert 0 <= a["label"].min() and a["label"].max() < 5
  state = whole.get_state()
  nxt = next(whole)
  whole.set_state(state)
  np.testing.assert_array_equal(next(whole)["label"], nxt["label"])


# --- errors and corrupt files -------------------------------------------------------------------

@pytest.fixture
def corrupt_root(tmp_path):
  write_image_folder(tmp_path, num_classes=2, train_per_class=5, val_per_class=1, image_size=32)
  folder = tmp_path / "train" / "n00000000"
  good = (folder / "n00000000_0.JPEG").read_bytes()
  (folder / "truncated.JPEG").write_bytes(good[:len(good) // 2])
  (folder / "noise.JPEG").write_bytes(np.random.default_rng(0).bytes(2000))
  return tmp_path


def test_corrupt_files_skipped_and_counted(corrupt_root):
  ds = ImageFolder(corrupt_root, "train")
  assert len(ds) == 12
  ev = loader(ds, 12, train=False, drop_remainder=False, on_corrupt="skip")
  b = next(ev)
  assert ev.corrupt_count == 2 and b["mask"].sum() == 10
  bad = {os.path.basename(ds.paths[i]) for i in ev.example_indices(0, 0)[~b["mask"]]}
  assert bad == {"truncated.JPEG", "noise.JPEG"}
  tr = loader(ds, 12, train=True, on_corrupt="skip")
  batch = next(tr)  # full batch: the two slots refilled from readable images
  assert tr.corrupt_count == 2 and batch["image"].reshape(12, -1).std(axis=1).min() > 5


@pytest.mark.parametrize("train", [True, False])
def test_corrupt_file_raises_naming_it(corrupt_root, train):
  ds = ImageFolder(corrupt_root, "train")
  with pytest.raises(CorruptImageError, match=r"(truncated|noise)\.JPEG"):
    next(loader(ds, 12, train=train, on_corrupt="raise"))


def test_class_count_mismatch(root):
  with pytest.raises(ValueError, match=r"1000.*\b10\b"):
    ImageFolder(root, "train", num_classes=1000)


def test_missing_and_empty_folders(tmp_path):
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
    ImageFolder(tmp_path / "nope", "train")
  with pytest.raises(FileNotFoundError, match="train"):
    ImageFolder(tmp_path, "train")
  (tmp_path / "train").mkdir()
  with pytest.raises(ValueError, match=str(tmp_path / "train")):
    ImageFolder(tmp_path, "train")
  (tmp_path / "train" / "n01").mkdir()
  with pytest.raises(ValueError, match=str(tmp_path / "train" / "n01")):
    ImageFolder(tmp_path, "train")
  (tmp_path / "val").mkdir()
  Image.new("RGB", (8, 8)).save(tmp_path / "val" / "x.JPEG")
  with pytest.raises(FileNotFoundError, match="labels"):
    ImageFolder(tmp_path, "val")


# --- eval coverage ------------------------------------------------------------------------------

def test_eval_covers_every_example_exactly_once(root):
  ds = ImageFolder(root, "val")  # 40 images, global batches of 12: the last one is padded
  seen, labels = [], []
  for p in (0, 1):
    ev = loader(ds, 12, train=False, drop_remainder=False, num_epochs=1, process_index=p,
                process_count=2)
    assert ev.batches_per_epoch == math.ceil(40 / 12)
    for index, b in enumerate(ev):
      seen.append(ev.example_indices(0, index)[b["mask"]])
      labels.append(b["label"][b["mask"]])
    assert index == ev.batches_per_epoch - 1
  seen, labels = np.concatenate(seen), np.concatenate(labels)
  assert sorted(seen.tolist()) == list(range(len(ds)))
  np.testing.assert_array_equal(labels, ds.labels[seen])
