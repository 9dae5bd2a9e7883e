"""grain's multiprocessing map/batch pipeline beside ``jaxring.data.ImageLoader``, same decoder.

  $ .venv/bin/pip install grain        # not a jaxring dependency
  $ .venv/bin/python benchmarks/scripts/grain_vs_loader.py --files 512 --workers 1,2
  $ .venv/bin/python benchmarks/scripts/grain_vs_loader.py --files 64 --batch-size 32 \
      --workers 1 --batches 1 --reps 1 --out-dir /tmp    # smoke run, ~10 s

Both pipelines do the same per-image work: jaxring's libjpeg-turbo decoder
(``make_decoder("turbo", 224).decode_into``, train transform: random-resized crop + flip seeded by
``(seed, epoch, example)`` as the loader seeds it) into 224x224x3 uint8, batches of 128. jaxring:
``ImageLoader(worker_type="process", decoder="turbo")``, timed by ``jaxring bench data``'s own
``measure``. grain: ``MapDataset.source(paths).map_with_index(decode).batch(128)
.to_iter_dataset(ReadOptions(num_threads=--grain-threads)).mp_prefetch(MultiprocessingOptions(W))``,
with OpenCV held to one thread in its workers as the loader's are.

For each worker count W it times ``--batches`` batches after ``--warmup`` batch(es) (which start
the workers), ``--reps`` consecutive windows, and reports the medians of images/s (wall clock) and
CPU ms per image (this process's CPU time plus that of its live worker processes, read from /proc).
The files are JPEGs of ImageNet's typical size written with ``write_image_folder`` (shorter side
375 px, quality 90, as ``jaxring bench data`` writes them), read once so that they are in the page
cache. Before timing, it checks that both give batches of the same shape and dtype and that
grain's eval-transform batch (center crop, no randomness) is byte-identical to the loader's.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

from jaxring._src.tools.bench import common
from jaxring._src.tools.bench.data import _ints, _proc_cpu_seconds, measure

IMAGE_SIZE, SOURCE_SIZE, SEED = 224, 375, 0
COLUMNS = (("loader", "loader", "s"), ("workers", "workers", "d"),
           ("images_per_s", "images/s", ".0f"), ("cpu_ms_per_image", "CPU ms/image", ".2f"),
           ("startup_s", "start-up s", ".2f"))


class Decode:
  """grain's per-element map: one file -> [224, 224, 3] uint8 with jaxring's decoder (picklable;
  the decoder is made once per worker process)."""

  def __init__(self, train: bool):
    self.train, self._decoder = train, None

  def __getstate__(self):
    return {"train": self.train}

  def __setstate__(self, state):
    self.train, self._decoder = state["train"], None

  def __call__(self, index: int, path: str) -> np.ndarray:
    if self._decoder is None:
      from jaxring._src.data.decode import limit_library_threads, make_decoder
      limit_library_threads()
      self._decoder = make_decoder("turbo", IMAGE_SIZE)
    out = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    # the loader's seed of example ``index`` in epoch 0 (jaxring/_src/data/workers.py)
    self._decoder.decode_into(out, path, train=self.train,
                              seed=(SEED, 0, index) if self.train else None)
    return out


def _limit_threads(worker_index: int, worker_count: int) -> None:
  from jaxring._src.data.decode import limit_library_threads
  limit_library_threads()


def grain_iter(paths: list[str], *, train: bool, batch: int, workers: int, threads: int):
  import grain
  ds = grain.MapDataset.source(paths).map_with_index(Decode(train))
  ds = ds.batch(batch, drop_remainder=True)
  if train:
    ds = ds.repeat()  # enough batches for warm-up + reps windows on a small file set
  it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2))
  it_ds = it_ds.mp_prefetch(grain.multiprocessing.MultiprocessingOptions(num_workers=workers),
                            worker_init_fn=_limit_threads)
  return iter(it_ds)


def _children_cpu_seconds() -> float:
  """This process's CPU time plus that of its live child processes (grain's workers)."""
  return time.process_time() + _proc_cpu_seconds([p.pid for p in multiprocessing.active_children()]
                                                 + _grandchildren())


def _grandchildren() -> list[int]:
  """Every live descendant of this process not known to ``multiprocessing`` (e.g. spawned
  helpers), from /proc/<pid>/task/*/children; [] where unreadable."""
  known = {p.pid for p in multiprocessing.active_children()}
  todo, seen = [os.getpid()], []
  while todo:
    pid = todo.pop()
    for task in pathlib.Path(f"/proc/{pid}/task").glob("*"):
      try:
        kids = [int(k) for k in (task / "children").read_text().split()]
      except OSError:
        continue
      for k in kids:
        if k not in seen:
          seen.append(k)
          todo.append(k)
  return [k for k in seen if k not in known]


def measure_grain(paths: list[str], *, batch_size: int, workers: int, threads: int, batches: int,
                  warmup: int, reps: int) -> dict:
  rates, cpu_ms = [], []
  start = time.perf_counter()
  it = grain_iter(paths, train=True, batch=batch_size, workers=workers, threads=threads)
  try:
    for _ in range(warmup):
      batch = next(it)
    startup = time.perf_counter() - start
    assert batch.shape == (batch_size, IMAGE_SIZE, IMAGE_SIZE, 3) and batch.dtype == np.uint8
    for _ in range(reps):
      t0, cpu = time.perf_counter(), _children_cpu_seconds()
      for _ in range(batches):
        next(it)
      wall, cpu = time.perf_counter() - t0, _children_cpu_seconds() - cpu
      rates.append(batches * batch_size / wall)
      cpu_ms.append(1e3 * cpu / (batches * batch_size))
  finally:
    if hasattr(it, "close"):
      it.close()
  return {"loader": "grain", "workers": workers, "grain_threads": threads,
          "images_per_s": statistics.median(rates), "cpu_ms_per_image": statistics.median(cpu_ms),
          "startup_s": startup, "images_per_s_reps": rates, "cpu_ms_per_image_reps": cpu_ms}


def _loader(ds, *, train: bool, batch_size: int, workers: int):
  from jaxring.data import ImageLoader
  return ImageLoader(ds, batch_size, train=train, image_size=IMAGE_SIZE, num_workers=workers,
                     worker_type="process", decoder="turbo", process_index=0, process_count=1,
                     prefetch=2)


def measure_loader(ds, *, batch_size: int, workers: int, batches: int, reps: int) -> dict:
  start = time.perf_counter()  # start-up: construction to the first batch, as for grain
  with _loader(ds, train=True, batch_size=batch_size, workers=workers) as loader:
    next(loader)
    startup = time.perf_counter() - start
  row = measure(ds, image_size=IMAGE_SIZE, train=True, workers=workers, worker_type="process",
                decoder="turbo", batch_size=batch_size, batches=batches, reps=reps)
  return {"loader": "jaxring", "workers": workers, "images_per_s": row["images_per_s"],
          "cpu_ms_per_image": row["cpu_ms_per_image"], "startup_s": startup,
          "images_per_s_reps": row["images_per_s_reps"],
          "cpu_ms_per_image_reps": row["cpu_ms_per_image_reps"]}


def check_same(ds, batch_size: int, workers: int, threads: int) -> None:
  """Same shape and dtype in both; grain's eval batch 0 byte-identical to the loader's."""
  with _loader(ds, train=False, batch_size=batch_size, workers=workers) as loader:
    ours = np.asarray(next(loader)["image"]).copy()
    indices = loader.example_indices(0, 0)
  it = grain_iter([ds.paths[i] for i in indices], train=False, batch=batch_size, workers=workers,
                  threads=threads)
  try:
    theirs = np.asarray(next(it)).copy()
  finally:
    if hasattr(it, "close"):
      it.close()
  assert ours.shape == theirs.shape == (batch_size, IMAGE_SIZE, IMAGE_SIZE, 3), (ours.shape,
                                                                                theirs.shape)
  assert ours.dtype == theirs.dtype == np.uint8, (ours.dtype, theirs.dtype)
  assert np.array_equal(ours, theirs), "grain's eval batch differs from ImageLoader's"
  print(f"shapes: {ours.shape} {ours.dtype} both; same pixels: yes", flush=True)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--files", type=int, default=512)
  ap.add_argument("--workers", default="1,2")
  ap.add_argument("--batch-size", type=int, default=128)
  ap.add_argument("--batches", type=int, default=6, help="batches per timed window")
  ap.add_argument("--warmup", type=int, default=1, help="batches before timing (starts workers)")
  ap.add_argument("--reps", type=int, default=3, help="timed windows per row (medians)")
  ap.add_argument("--grain-threads", type=int, default=1,
                  help="grain ReadOptions.num_threads per worker (grain's default is 16)")
  ap.add_argument("--out-dir", default=None, help="default benchmarks/results")
  args = ap.parse_args(argv)
  from importlib.metadata import version

  import grain  # noqa: F401 (fail early: pip install grain)
  from absl import flags

  from jaxring.data import ImageFolder, write_image_folder

  # grain reads absl flags (--grain_enable_multiprocess_worker_profiling, ...) when its workers
  # start; a script that does not run absl.app must mark them parsed (their defaults) itself
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()

  if args.files < args.batch_size:
    ap.error(f"--files must be at least --batch-size {args.batch_size}")
  cpus = len(os.sched_getaffinity(0))
  rows = []
  with tempfile.TemporaryDirectory(prefix="jaxring-grain-vs-loader-") as tmp:
    write_image_folder(tmp, num_classes=8, train_per_class=max(1, args.files // 8),
                       val_per_class=1, image_size=SOURCE_SIZE, quality=90)
    ds = ImageFolder(tmp, "train")
    sizes = [len(pathlib.Path(p).read_bytes()) for p in ds.paths]  # into the page cache
    print(f"{len(ds)} files, mean {np.mean(sizes) / 1024:.0f} KiB, shorter side {SOURCE_SIZE} px; "
          f"{cpus} CPUs; batch {args.batch_size}, {args.batches} batches x {args.reps} reps per "
          f"row; grain {version('grain')}", flush=True)
    check_same(ds, args.batch_size, _ints(args.workers)[0], args.grain_threads)
    for workers in _ints(args.workers):
      rows.append(measure_loader(ds, batch_size=args.batch_size, workers=workers,
                                 batches=args.batches, reps=args.reps))
      print(f"  jaxring x{workers}: {rows[-1]['images_per_s']:.0f} images/s", file=sys.stderr,
            flush=True)
      rows.append(measure_grain(ds.paths, batch_size=args.batch_size, workers=workers,
                                threads=args.grain_threads, batches=args.batches,
                                warmup=args.warmup, reps=args.reps))
      print(f"  grain x{workers}: {rows[-1]['images_per_s']:.0f} images/s", file=sys.stderr,
            flush=True)
  common.print_table(rows, COLUMNS)
  path = common.write_json("grain-vs-loader", {
      "rows": rows, "files": len(ds), "mean_file_bytes": float(np.mean(sizes)),
      "source_size": SOURCE_SIZE, "image_size": IMAGE_SIZE, "batch_size": args.batch_size,
      "batches": args.batches, "warmup": args.warmup, "reps": args.reps,
      "grain_threads": args.grain_threads, "grain": version("grain"), "cpus": cpus,
      "same_pixels": True, "machine": common.machine()}, args.out_dir)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
