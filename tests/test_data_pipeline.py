"""The fast input pipeline: the libjpeg-turbo decoder against a PIL reference, worker processes
against threads, bad files of every kind, the DALI backend's absence, and `jaxring bench data`."""
import glob
import json
import logging
import os
import tomllib

import numpy as np
import pytest
from PIL import Image

from jaxring._src.data import decode
from jaxring.data import (CorruptImageError, DaliImageLoader, ImageFolder, ImageLoader,
                          dali_error, make_train_loader, random_resized_crop_box,
                          write_image_folder)

needs_turbo = pytest.mark.skipif(decode.fast_decoder_error() is not None,
                                 reason="simplejpeg / opencv-python-headless not installed")


def smooth_image(width: int, height: int) -> np.ndarray:
  """Gradients and a slow wave: resamplers agree on it, and any shift or flip shows."""
  yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
  return np.stack([255 * xx / width, 255 * yy / height,
                   127 + 100 * np.sin(xx / 23.0) * np.cos(yy / 31.0)], -1).astype(np.uint8)


def pil_reference(path, box, image_size: int, flip: bool) -> np.ndarray:
  """Full decode, crop, PIL's antialiased bilinear resize, flip: the transform by definition."""
  x, y, w, h = box
  image = Image.open(path).convert("RGB").resize((image_size, image_size),
                                                 Image.Resampling.BILINEAR,
                                                 box=(x, y, x + w, y + h))
  out = np.asarray(image)
  return out[:, ::-1] if flip else out


def mean_abs(a, b) -> float:
  return float(np.abs(a.astype(np.int32) - b.astype(np.int32)).mean())


# --- the decoder ---------------------------------------------------------------------------------

@needs_turbo
@pytest.mark.parametrize("image_size", [224, 48])  # 48: the crops decode at 1/2..1/8 DCT scale
def test_turbo_train_crop_matches_pil_reference(tmp_path, image_size):
  path = str(tmp_path / "big.JPEG")
  Image.fromarray(smooth_image(800, 600)).save(path, quality=95)
  dec = decode.TurboDecoder(image_size)
  out = np.empty((image_size, image_size, 3), np.uint8)
  flips, scales = set(), set()
  for example in range(8):
    seed = (7, 0, example)
    rng = np.random.default_rng(seed)
    box = random_resized_crop_box(800, 600, rng)
    flip = rng.random() < 0.5
    flips.add(flip)
    scales.add(decode.dct_scale(box, image_size))
    dec.decode_into(out, path, train=True, seed=seed)
    want = pil_reference(path, box, image_size, flip)
    # at 48 px the wave is near the output's Nyquist rate: bilinear after DCT scaling and PIL's
    # antialiasing filter differ most there
    assert mean_abs(out, want) < (3.0 if image_size == 224 else 5.0), (example, box, flip)
    assert mean_abs(out, want[:, ::-1]) > 3 * mean_abs(out, want)  # the flip is discriminated
  assert flips == {True, False}
  if image_size == 48:
    assert max(scales) >= 4


@needs_turbo
def test_turbo_eval_center_crop_matches_pil_reference(tmp_path):
  path = str(tmp_path / "wide.jpg")
  Image.fromarray(smooth_image(500, 375)).save(path, quality=95)
  out = np.empty((224, 224, 3), np.uint8)
  decode.TurboDecoder(224).decode_into(out, path, train=False)
  side = 0.875 * 375
  want = pil_reference(path, ((500 - side) / 2, (375 - side) / 2, side, side), 224, False)
  assert mean_abs(out, want) < 2.0
  shifted = pil_reference(path, (0, 0, side, side), 224, False)
  assert mean_abs(out, shifted) > 5.0


def test_dct_scale_keeps_the_output_resolution():
  assert decode.dct_scale((0, 0, 500, 375), 64) == 4      # 375 / 4 = 93 >= 64 > 375 / 8
  assert decode.dct_scale((0, 0, 500, 375), 224) == 1
  assert decode.dct_scale((10, 10, 460, 450), 224) == 2
  assert decode.dct_scale((0, 0, 100, 100), 224) == 1     # an enlarged crop: full size
  for w, h, size in [(375, 500, 32), (800, 600, 100), (64, 64, 8)]:
    s = decode.dct_scale((0, 0, w, h), size)
    assert w / s >= size and h / s >= size
    assert s == 8 or w / (2 * s) < size or h / (2 * s) < size


def test_decoder_choice_and_errors(monkeypatch, caplog):
  with pytest.raises(ValueError, match="decoder"):
    decode.resolve_decoder("nvjpeg")
  monkeypatch.setattr(decode, "_IMPORT_ERROR", ImportError("No module named 'simplejpeg'"))
  monkeypatch.setattr(decode, "_warned", [])
  assert decode.resolve_decoder("auto") == "pil"
  assert decode.resolve_decoder("auto") == "pil"
  warnings = [r.getMessage() for r in caplog.records if "Pillow" in r.getMessage()]
  assert len(warnings) == 1 and "simplejpeg" in warnings[0]
  assert decode.resolve_decoder("pil") == "pil"
  with pytest.raises(ImportError, match="simplejpeg"):
    decode.resolve_decoder("turbo")


# --- bad files ----------------------------------------------------------------------------------

RED, GREEN = (255, 0, 0), (0, 200, 0)


@pytest.fixture(scope="module")
def odd_root(tmp_path_factory):
  """An ImageNet-layout folder with every kind of odd file the real one has, and worse."""
  root = tmp_path_factory.mktemp("odd")
  write_image_folder(root, num_classes=2, train_per_class=4, val_per_class=1, image_size=48)
  folder = root / "train" / "n00000000"
  good = (folder / "n00000000_0.JPEG").read_bytes()
  Image.new("CMYK", (60, 50), (0, 255, 255, 0)).save(folder / "cmyk.JPEG", "JPEG")
  Image.new("L", (60, 50), 100).save(folder / "gray.JPEG", "JPEG")
  Image.new("RGB", (60, 50), GREEN).save(folder / "png.JPEG", "PNG")  # PNG bytes, JPEG name
  (folder / "truncated.JPEG").write_bytes(good[:len(good) // 2])
  (folder / "empty.JPEG").write_bytes(b"")
  (folder / "noise.JPEG").write_bytes(b"\xff\xd8" + np.random.default_rng(0).bytes(3000))
  sof = good.index(b"\xff\xc0") + 5  # baseline frame header: length, precision, then H, W
  (folder / "bomb.JPEG").write_bytes(good[:sof] + (60000).to_bytes(2, "big") * 2 + good[sof + 4:])
  return root


BAD = {"truncated.JPEG", "empty.JPEG", "noise.JPEG", "bomb.JPEG"}


@pytest.mark.parametrize("decoder", ["auto", "pil"])
def test_odd_files_decode_or_are_logged_and_skipped(odd_root, decoder, caplog):
  ds = ImageFolder(odd_root, "train")
  assert len(ds) == 15
  caplog.set_level(logging.WARNING, logger="jaxring._src.data.loader")
  with ImageLoader(ds, 15, train=False, image_size=32, drop_remainder=False, num_workers=2,
                   process_index=0, process_count=1, decoder=decoder) as ev:
    batch = next(ev)
    names = [os.path.basename(ds.paths[i]) for i in ev.example_indices(0, 0)]
  masked_out = {n for n, keep in zip(names, batch["mask"]) if not keep}
  assert masked_out == BAD and ev.corrupt_count == 4
  logged = " ".join(r.getMessage() for r in caplog.records)
  assert all(name in logged for name in BAD)
  image = dict(zip(names, batch["image"]))
  assert np.abs(image["cmyk.JPEG"].astype(int) - RED).max() < 40
  assert np.abs(image["gray.JPEG"].astype(int) - 100).max() <= 3
  assert np.abs(image["png.JPEG"].astype(int) - GREEN).max() <= 1


def test_odd_files_in_training_refill_the_batch(odd_root):
  ds = ImageFolder(odd_root, "train")
  with ImageLoader(ds, 15, train=True, image_size=32, num_workers=2, process_index=0,
                   process_count=1) as tr:
    batch = next(tr)  # every slot filled: the bad files' slots from the next readable examples
    assert tr.corrupt_count == 4
  assert batch["image"].reshape(15, -1).max(axis=1).min() > 0


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_odd_file_raises_naming_it(odd_root, worker_type):
  ds = ImageFolder(odd_root, "train")
  with ImageLoader(ds, 15, train=False, image_size=32, on_corrupt="raise", num_workers=2,
                   process_index=0, process_count=1, worker_type=worker_type) as ev:
    with pytest.raises(CorruptImageError, match=r"(truncated|empty|noise|bomb)\.JPEG"):
      next(ev)


# --- processes and threads ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_root(tmp_path_factory):
  root = tmp_path_factory.mktemp("small")
  write_image_folder(root, num_classes=4, train_per_class=10, val_per_class=2, image_size=64)
  return root


def loader(ds, **kw):
  kw.setdefault("process_index", 0)
  kw.setdefault("process_count", 1)
  return ImageLoader(ds, 16, train=True, image_size=40, seed=5, **kw)


def test_processes_and_threads_yield_the_same_batches(small_root):
  ds = ImageFolder(small_root, "train")  # 40 images: 2 batches of 16 per epoch
  with loader(ds, worker_type="process", num_workers=2) as a, \
       loader(ds, worker_type="thread", num_workers=1, prefetch=0) as b:
    for _ in range(5):  # crosses two epoch boundaries
      x, y = next(a), next(b)
      np.testing.assert_array_equal(x["image"], y["image"])
      np.testing.assert_array_equal(x["label"], y["label"])
    assert a.worker_cpu_seconds > 0 and len(a.worker_pids()) >= 1 and b.worker_pids() == []


def test_process_workers_resume_and_shard(small_root):
  ds = ImageFolder(small_root, "train")
  with loader(ds, num_workers=2) as straight:
    [next(straight) for _ in range(3)]
    state = straight.get_state()
    expected = [next(straight) for _ in range(3)]
  with loader(ds, num_workers=1) as resumed:
    next(resumed)  # prefetched batches in flight, discarded by set_state
    resumed.set_state(state)
    for want in expected:
      np.testing.assert_array_equal(next(resumed)["image"], want["image"])
  parts = []
  for p in (0, 1):
    with loader(ds, num_workers=1, process_index=p, process_count=2) as half:
      half.set_state(state)
      parts.append(next(half))
  np.testing.assert_array_equal(np.concatenate([q["image"] for q in parts]), expected[0]["image"])


def shared_files() -> set:
  pattern = f"jaxring-data-{os.getpid()}-*"
  return set(glob.glob(os.path.join("/dev/shm", pattern)) + glob.glob(
      os.path.join(os.environ.get("TMPDIR", "/tmp"), pattern)))


def test_process_workers_leave_no_shared_memory_or_processes(small_root):
  ds = ImageFolder(small_root, "train")
  before = shared_files()
  with loader(ds, num_workers=2) as it:
    batch = next(it)
    # the ring, the path table, its offsets and the labels are unlinked once every worker has
    # mapped them: a loader killed by SIGKILL leaves nothing behind
    assert shared_files() == before
    pid = it.worker_pids()[0]
    next(it)
  assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()
  assert batch["image"].std() > 5  # the returned batch is the caller's own copy
  dropped = loader(ds, num_workers=1)
  next(dropped)
  (pid,) = dropped.worker_pids()
  del dropped  # never closed: garbage collection stops its worker
  assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc/<pid>/maps (Linux)")
def test_worker_processes_decode_without_jax(small_root):
  ds = ImageFolder(small_root, "train")
  with loader(ds, num_workers=1) as it:
    next(it)
    (pid,) = it.worker_pids()
    maps = open(f"/proc/{pid}/maps").read()
  assert "jaxlib" not in maps and "libjpeg" in maps.lower()


def test_a_dead_worker_fails_the_batch_instead_of_hanging(small_root):
  import signal
  ds = ImageFolder(small_root, "train")
  with loader(ds, num_workers=1) as it:
    next(it)
    os.kill(it.worker_pids()[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match="died"):
      for _ in range(6):  # the batches decoded before the kill come first
        next(it)


def test_bad_worker_type():
  with pytest.raises(ValueError, match="worker_type"):
    ImageLoader(None, 8, train=True, worker_type="greenlet")


# --- DALI where it is absent --------------------------------------------------------------------

needs_no_dali = pytest.mark.skipif(dali_error() is None, reason="DALI and a GPU are present")


@needs_no_dali
def test_dali_absent_is_a_clear_error(small_root):
  ds = ImageFolder(small_root, "train")
  assert "dali" in dali_error().lower()
  with pytest.raises(ImportError, match=r"jaxring\[dali\]|GPU"):
    DaliImageLoader(ds, 16)
  with pytest.raises(ImportError, match=r"jaxring\[dali\]|GPU"):
    make_train_loader(ds, 16, backend="dali")
  with make_train_loader(ds, 16, backend="auto", image_size=32, process_index=0,
                         process_count=1, worker_type="thread") as fallback:
    assert isinstance(fallback, ImageLoader) and next(fallback)["image"].shape == (16, 32, 32, 3)
  with pytest.raises(ValueError, match="backend"):
    make_train_loader(ds, 16, backend="tpu")


def test_dali_is_an_optional_extra():
  with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  assert any(d.startswith("nvidia-dali") for d in project["optional-dependencies"]["dali"])
  assert not any(d.startswith("nvidia-dali") for d in project["dependencies"])
  assert {"simplejpeg", "opencv-python-headless"} <= {
      d.split(">")[0].split("=")[0].strip() for d in project["optional-dependencies"]["data"]}


# --- jaxring bench data -------------------------------------------------------------------------

@needs_turbo
def test_bench_data_rows_and_json(tmp_path, capsys):
  from jaxring._src.tools.bench import data as bench_data
  bench_data.main(["--source-size", "64", "--files", "16", "--batch-size", "8", "--batches", "1",
                   "--reps", "2",
                   "--workers", "1,2", "--worker-types", "thread", "--decoders", "pil",
                   "--image-sizes", "32", "--gpu-rate", "1e9", "--stages",
                   "--out-dir", str(tmp_path)])
  out = capsys.readouterr().out
  (path,) = glob.glob(str(tmp_path / "data.json"))
  result = json.loads(open(path).read())
  rows = result["rows"]
  stages = {r["stage"]: r["cpu_ms_per_image"] for r in result["stages"]}
  assert stages["simplejpeg decode 1/8"] > 0 and "OpenCV bilinear crop->32" in stages
  assert [(r["transform"], r["workers"]) for r in rows] == [("train", 1), ("train", 2),
                                                             ("eval", 1), ("eval", 2)]
  assert all(r["images_per_s"] > 0 and r["cpu_ms_per_image"] > 0 for r in rows)
  assert all(len(r["images_per_s_reps"]) == 2 and
             min(r["images_per_s_reps"]) <= r["images_per_s"] <= max(r["images_per_s_reps"])
             for r in rows)
  assert all(r["scaling"] == pytest.approx(r["images_per_s"] / (r["workers"] * single))
             for r, single in zip(rows, [rows[0]["images_per_s"]] * 2 +
                                  [rows[2]["images_per_s"]] * 2))
  assert out.count("input-bound by") == 4 and "CPU ms/image" in out


@needs_no_dali
def test_recipe_data_backend_flag(tmp_path):
  from recipes import input_pipeline
  from recipes.config import Config

  config = Config(dataset="generated", data_dir=str(tmp_path), num_classes=2, train_per_class=8,
                  val_per_class=1, generated_image_size=32, image_size=24, batch_size=8,
                  num_workers=1)
  with pytest.raises(ImportError, match=r"jaxring\[dali\]|GPU"):
    input_pipeline.train_batches(Config(**{**config.__dict__, "data_backend": "dali"}))
  batches, steps = input_pipeline.train_batches(Config(**{**config.__dict__,
                                                          "data_backend": "auto"}))
  with batches:
    assert isinstance(batches, ImageLoader) and steps == 2
    assert next(batches)["image"].shape == (8, 24, 24, 3)
