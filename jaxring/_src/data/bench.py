"""Input pipeline throughput: images/s of decode + augment by ``ImageLoader``.

Command: ``python -m jaxring._src.data.bench [--image-sizes 64,224] [--workers 1,2]``. It writes
JPEG files of ImageNet's typical size (shorter side 375 px, about 375x450 on average, quality
90) with :func:`write_image_folder` into a temporary folder, reads them once so that they are in
the page cache, and then times whole batches, train and eval transforms, per worker count. It
prints a table and, with ``--json``, writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile
import time

import numpy as np

from jaxring._src.data.folder import ImageFolder
from jaxring._src.data.generate import write_image_folder
from jaxring._src.data.loader import ImageLoader


def measure(ds: ImageFolder, *, image_size: int, train: bool, workers: int, batch_size: int,
            batches: int) -> tuple[float, float]:
  """Images/s (wall clock) and CPU ms per image over ``batches`` batches after a warm-up batch.

  The CPU time is the whole process's (all threads), so it is the cost per image that no
  contention for the cores changes; images/s is what this machine delivered meanwhile.
  """
  with ImageLoader(ds, batch_size, train=train, image_size=image_size, num_workers=workers,
                   process_index=0, process_count=1, prefetch=2) as loader:
    next(loader)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
      next(loader)
    images = batches * batch_size
    return (images / (time.perf_counter() - start),
            1e3 * (time.process_time() - cpu) / images)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--image-sizes", default="64,224")
  parser.add_argument("--workers", default="1,2")
  parser.add_argument("--source-size", type=int, default=375, help="shorter side of the JPEGs")
  parser.add_argument("--files", type=int, default=256)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--batches", type=int, default=8)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    write_image_folder(tmp, num_classes=8, train_per_class=args.files // 8, val_per_class=1,
                       image_size=args.source_size)
    ds = ImageFolder(tmp, "train")
    sizes = [os.path.getsize(p) for p in ds.paths]
    for p in ds.paths:
      pathlib.Path(p).read_bytes()
    print(f"{len(ds)} JPEG files, mean {np.mean(sizes) / 1024:.0f} KiB, shorter side "
          f"{args.source_size} px; {os.cpu_count()} CPUs; batch {args.batch_size}")
    print("| image_size | transform | workers | images/s | CPU ms/image |\n"
          "|---:|---|---:|---:|---:|")
    for image_size in (int(s) for s in args.image_sizes.split(",")):
      for train in (True, False):
        for workers in (int(w) for w in args.workers.split(",")):
          rate, cpu_ms = measure(ds, image_size=image_size, train=train, workers=workers,
                         batch_size=args.batch_size, batches=args.batches)
          transform = "train (crop+flip)" if train else "eval (center)"
          print(f"| {image_size} | {transform} | {workers} | {rate:.0f} | {cpu_ms:.2f} |",
                flush=True)
          rows.append({"image_size": image_size, "train": train, "workers": workers,
                       "images_per_s": rate, "cpu_ms_per_image": cpu_ms,
                       "source_size": args.source_size,
                       "mean_file_bytes": float(np.mean(sizes))})
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  return rows


if __name__ == "__main__":
  main()
