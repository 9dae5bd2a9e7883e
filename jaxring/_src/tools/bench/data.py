"""Input pipeline throughput: images/s and CPU ms per image of ``jaxring.data.ImageLoader``.

For each image size, transform (train: random-resized crop + flip; eval: center crop), decoder,
worker type and worker count, it times ``--batches`` whole batches after a warm-up batch and
reports images/s (wall clock) and the CPU time per image of this process and its worker
processes together (the cost that contention for the cores does not change), each the median of
``--reps`` consecutive windows, and the scaling efficiency: images/s over ``workers x`` the
one-worker rate of the same configuration.

The images are JPEG files of ImageNet's typical size written with ``write_image_folder`` (shorter
side ``--source-size`` 375 px, longer side up to 1.4x, quality 90) into a temporary folder, or an
ImageNet-layout folder of your own (``--data-dir``), read once so that they are in the page cache.

With ``--gpu-rate`` (the images/s the accelerator trains at, e.g. from ``jaxring bench resnet50``)
each row also says whether the pipeline keeps up: "input-bound by X" is how many times slower
than the accelerator it is.

``--stages`` also times, on one thread, each stage the decoders are built from (reading a file,
libjpeg-turbo decoding at each scale, PIL's decode, OpenCV's and PIL's resize of the crop).

Example:
  $ jaxring bench data --image-sizes 224 --workers 1,2 --decoders turbo,pil --stages
  $ jaxring bench data --workers 1,8,16 --gpu-rate 6480     # on a 16-core GPU host
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

from jaxring._src.extras import require
from jaxring._src.tools.bench import common

COLUMNS = (("image_size", "size", "d"), ("transform", "transform", "s"),
           ("decoder", "decoder", "s"), ("worker_type", "workers", "s"),
           ("workers", "n", "d"), ("images_per_s", "images/s", ".0f"),
           ("cpu_ms_per_image", "CPU ms/image", ".2f"), ("scaling", "scaling", ".2f"),
           ("vs_gpu", "vs GPU", "s"))


def _proc_cpu_seconds(pids) -> float:
  """User + system CPU seconds of the processes ``pids`` (Linux /proc; 0 where unreadable)."""
  tick = os.sysconf("SC_CLK_TCK")
  total = 0.0
  for pid in pids:
    try:
      fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
      continue
    total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
  return total


def _cpu_seconds(loader) -> float:
  """This process's CPU time (all threads) plus that of the loader's worker processes."""
  return time.process_time() + _proc_cpu_seconds(loader.worker_pids())


def measure(ds, *, image_size: int, train: bool, workers: int, worker_type: str, decoder: str,
            batch_size: int, batches: int, reps: int = 1) -> dict:
  """One row: the medians over ``reps`` consecutive windows of ``batches`` batches (after a
  warm-up batch) of images/s and CPU ms per image; each window's figures are kept too."""
  from jaxring.data import ImageLoader

  rates, cpu_ms = [], []
  with ImageLoader(ds, batch_size, train=train, image_size=image_size, num_workers=workers,
                   worker_type=worker_type, decoder=decoder, process_index=0, process_count=1,
                   prefetch=2) as loader:
    next(loader)  # starts the workers, fills the pipeline
    for _ in range(reps):
      start, cpu = time.perf_counter(), _cpu_seconds(loader)
      for _ in range(batches):
        next(loader)
      wall, cpu = time.perf_counter() - start, _cpu_seconds(loader) - cpu
      rates.append(batches * batch_size / wall)
      cpu_ms.append(1e3 * cpu / (batches * batch_size))
  return {"image_size": image_size, "transform": "train" if train else "eval",
          "decoder": loader.decoder, "worker_type": worker_type, "workers": workers,
          "images_per_s": statistics.median(rates), "cpu_ms_per_image": statistics.median(cpu_ms),
          "images_per_s_reps": rates, "cpu_ms_per_image_reps": cpu_ms}


def _add_comparisons(rows: list[dict], gpu_rate: float | None) -> None:
  single = {}
  for r in rows:
    key = (r["image_size"], r["transform"], r["decoder"], r["worker_type"])
    if r["workers"] == 1:
      single[key] = r["images_per_s"]
    if key in single:
      r["scaling"] = r["images_per_s"] / (r["workers"] * single[key])
    if gpu_rate:
      ratio = gpu_rate / r["images_per_s"]
      r["vs_gpu"] = f"input-bound by {ratio:.1f}x" if ratio > 1 else f"keeps up ({1 / ratio:.1f}x)"


def _dataset(args, tmp: str):
  from jaxring.data import ImageFolder, write_image_folder

  if args.data_dir:
    ds = ImageFolder(args.data_dir, "train")
    keep = np.random.default_rng(0).permutation(len(ds))[:args.files]
    ds.paths = [ds.paths[i] for i in sorted(keep)]
    ds.labels = ds.labels[np.sort(keep)]
    return ds
  write_image_folder(tmp, num_classes=8, train_per_class=max(1, args.files // 8), val_per_class=1,
                     image_size=args.source_size, quality=90)
  return ImageFolder(tmp, "train")


def stage_costs(paths: list[str], image_size: int) -> list[dict]:
  """Single-threaded CPU ms per image of each stage the decoders are made of, on ``paths``."""
  import io

  needs = "jaxring bench data --stages needs Pillow, simplejpeg and OpenCV"
  cv2, simplejpeg, Image = (require(m, "data", needs) for m in ("cv2", "simplejpeg", "PIL.Image"))

  datas = [pathlib.Path(p).read_bytes() for p in paths]
  heights = [simplejpeg.decode_jpeg_header(d)[:2] for d in datas]
  pixels = [simplejpeg.decode_jpeg(d, "RGB") for d in datas]
  out = np.empty((image_size, image_size, 3), np.uint8)

  def crop(a):  # the eval crop: 87.5% of the shorter side, centered
    side = int(0.875 * min(a.shape[:2]))
    y, x = (a.shape[0] - side) // 2, (a.shape[1] - side) // 2
    return a[y:y + side, x:x + side]

  def scaled(num: int):
    return lambda i: simplejpeg.decode_jpeg(
        datas[i], "RGB", min_height=-(-heights[i][0] * num // 8),
        min_width=-(-heights[i][1] * num // 8))

  stages = {
      "read file": lambda i: pathlib.Path(paths[i]).read_bytes(),
      "simplejpeg decode 1/1": scaled(8),
      "simplejpeg decode 7/8": scaled(7),
      "simplejpeg decode 6/8": scaled(6),
      "simplejpeg decode 1/2": scaled(4),
      "simplejpeg decode 1/8": scaled(1),
      "PIL decode 1/1": lambda i: Image.open(io.BytesIO(datas[i])).load(),
      f"OpenCV bilinear crop->{image_size}": lambda i: cv2.resize(
          crop(pixels[i]), (image_size, image_size), dst=out, interpolation=cv2.INTER_LINEAR),
      f"OpenCV area crop->{image_size}": lambda i: cv2.resize(
          crop(pixels[i]), (image_size, image_size), dst=out, interpolation=cv2.INTER_AREA),
      f"PIL antialiased bilinear crop->{image_size}": lambda i: Image.fromarray(
          crop(pixels[i])).resize((image_size, image_size), Image.Resampling.BILINEAR),
  }
  rows = []
  for name, fn in stages.items():
    fn(0)
    start = time.thread_time()
    for i in range(len(datas)):
      fn(i)
    rows.append({"stage": name, "cpu_ms_per_image": 1e3 * (time.thread_time() - start) / len(datas)})
  return rows


def _ints(text: str) -> list[int]:
  return [int(t) for t in text.split(",") if t]


def main(argv=None) -> int:
  cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  default_workers = sorted({1, *[w for w in (2, 4, 8, 16, 32) if w < cpus], cpus})
  ap = argparse.ArgumentParser(prog="jaxring bench data", description=__doc__.splitlines()[0])
  ap.add_argument("--image-sizes", default="224")
  ap.add_argument("--transforms", default="train,eval")
  ap.add_argument("--workers", default=",".join(map(str, default_workers)))
  ap.add_argument("--worker-types", default="process", help="process,thread")
  ap.add_argument("--decoders", default="auto", help="auto,turbo,pil")
  ap.add_argument("--source-size", type=int, default=375, help="shorter side of the JPEGs")
  ap.add_argument("--files", type=int, default=512)
  ap.add_argument("--data-dir", default="", help="an ImageNet-layout folder to read instead")
  ap.add_argument("--batch-size", type=int, default=128)
  ap.add_argument("--batches", type=int, default=8, help="batches per timed window")
  ap.add_argument("--reps", type=int, default=3, help="timed windows per row (medians)")
  ap.add_argument("--gpu-rate", type=float, default=None,
                  help="the accelerator's training images/s: say whether the pipeline keeps up")
  ap.add_argument("--stages", action="store_true",
                  help="also time each stage (decode at each scale, resize) on one thread")
  ap.add_argument("--out-dir", default=None)
  args = ap.parse_args(argv)
  rows, stages = [], []
  with tempfile.TemporaryDirectory(prefix="jaxring-bench-data-") as tmp:
    ds = _dataset(args, tmp)
    sizes = [os.path.getsize(p) for p in ds.paths]
    for p in ds.paths:
      pathlib.Path(p).read_bytes()
    print(f"{len(ds)} files, mean {np.mean(sizes) / 1024:.0f} KiB"
          f"{'' if args.data_dir else f', shorter side {args.source_size} px'}; {cpus} CPUs; "
          f"batch {args.batch_size}, {args.batches} batches per row", flush=True)
    for image_size in _ints(args.image_sizes):
      for transform in args.transforms.split(","):
        for decoder in args.decoders.split(","):
          for worker_type in args.worker_types.split(","):
            for workers in _ints(args.workers):
              rows.append(measure(ds, image_size=image_size, train=transform == "train",
                                  workers=workers, worker_type=worker_type, decoder=decoder,
                                  batch_size=args.batch_size, batches=args.batches,
                                  reps=args.reps))
              print(f"  {rows[-1]['transform']} {image_size} {rows[-1]['decoder']} "
                    f"{worker_type} x{workers}: {rows[-1]['images_per_s']:.0f} images/s",
                    file=sys.stderr, flush=True)
    if args.stages:
      stages = stage_costs(ds.paths, _ints(args.image_sizes)[-1])
  _add_comparisons(rows, args.gpu_rate)
  common.print_table(rows, COLUMNS)
  if stages:
    print(f"\nper stage, one thread ({len(ds)} files):")
    common.print_table(stages, (("stage", "stage", "s"), ("cpu_ms_per_image", "CPU ms/image",
                                                         ".3f")))
  machine = common.machine()
  if args.gpu_rate is None and any("cuda" in d.lower() or "gpu" in d.lower()
                                   for d in machine["devices"]):
    print("a GPU is present: --gpu-rate <its training images/s> says whether this keeps up")
  path = common.write_json("data", {
      "rows": rows, "stages": stages, "files": len(ds), "mean_file_bytes": float(np.mean(sizes)),
      "source_size": None if args.data_dir else args.source_size, "cpus": cpus,
      "batch_size": args.batch_size, "batches": args.batches, "reps": args.reps, "gpu_rate": args.gpu_rate,
      "machine": machine}, args.out_dir)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
