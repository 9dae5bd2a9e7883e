"""The decode workers of :class:`jaxring.data.ImageLoader`: threads, or processes that write
into shared memory.

Both run :class:`ExampleFiller` on a range of a batch's slots and return the slots' labels, mask
and corrupt files to the loader, which logs and counts them. libjpeg-turbo (simplejpeg) and
OpenCV release the GIL, so threads do scale on a few cores. Processes are the default because the
Python around each image (the example's generator, the crop box, the file read, the calls) holds
it: a few percent of each image, a serial fraction that, with the cost of handing the GIL between
16 threads, caps threads well short of 16 cores (the PIL loader's 16 threads measured slower
than its 8 on a 16-core host).

A worker process decodes straight into its slots of a batch buffer in shared memory (a file in
``/dev/shm`` mapped by every process and unlinked once they all have), so an image is written once by its decoder and copied
once, with the whole batch, when the loader hands the batch out. The file list and labels sit in
shared memory as well, so starting a worker sends a few names, not ImageNet's 1.28 million paths.

Worker processes are fresh interpreters that import the decoders but not JAX
(:mod:`jaxring._src.data.processes` says why not ``multiprocessing``).
"""
from __future__ import annotations

import concurrent.futures
import os
import tempfile
import threading
import time
import uuid
import weakref
from typing import NamedTuple, Sequence

import numpy as np

from jaxring._src.data import decode
from jaxring._src.data.processes import ProcessPool
from jaxring._src.data.transforms import CorruptImageError

# A run of this many corrupt files in a row means the data set is broken, not one file.
MAX_CONSECUTIVE_CORRUPT = 64


class FillResult(NamedTuple):
  """What a worker reports for the slots ``[first, first + len(labels))`` of a batch."""
  first: int
  labels: np.ndarray      # int32
  mask: np.ndarray        # bool: the slot holds a real, decoded example
  corrupt: list           # [(path, message)] of the files that could not be decoded
  cpu_seconds: float      # the worker's CPU time for these slots


def epoch_order(seed: int, epoch: int, num_examples: int, train: bool) -> np.ndarray:
  """The example indices of ``epoch`` in the order the global batches take them."""
  if train:
    return np.random.default_rng((seed, epoch)).permutation(num_examples)
  return np.arange(num_examples)


class ExampleFiller:
  """Decodes examples into slots of a batch, with the loader's policy for corrupt files."""

  def __init__(self, paths: Sequence[str], labels: np.ndarray, *, train: bool, image_size: int,
               seed: int, drop_remainder: bool, on_corrupt: str, decoder: str):
    self.paths, self.labels = paths, labels
    self.num_examples = len(labels)
    self.train, self.image_size, self.seed = train, image_size, seed
    self.drop_remainder, self.on_corrupt, self.decoder = drop_remainder, on_corrupt, decoder
    self._local = threading.local()

  def _decoder(self):
    dec = getattr(self._local, "decoder", None)
    if dec is None:  # one per thread: a decoder owns scratch buffers
      dec = self._local.decoder = decode.make_decoder(self.decoder, self.image_size)
    return dec

  def fill(self, image: np.ndarray, first: int, stop: int, start: int, epoch: int,
           order: np.ndarray) -> FillResult:
    """Fills ``image[first:stop]`` with the examples at positions ``start + slot`` of ``order``.

    A corrupt file is reported; its slot is refilled from the next example of the order, or,
    where batches have a mask (``drop_remainder=False``), left masked out.
    """
    cpu = time.thread_time()
    dec = self._decoder()
    labels = np.zeros(stop - first, np.int32)
    mask = np.zeros(stop - first, np.bool_)
    corrupt = []
    for slot in range(first, stop):
      position = start + slot
      if position >= self.num_examples:
        continue  # padding of the last batch: zeros, masked out
      for attempt in range(MAX_CONSECUTIVE_CORRUPT):
        example = int(order[(position + attempt) % self.num_examples])
        path = self.paths[example]
        try:
          dec.decode_into(image[slot], path, train=self.train,
                          seed=(self.seed, epoch, example) if self.train else None)
        except CorruptImageError as e:
          if self.on_corrupt == "raise":
            raise
          corrupt.append((path, str(e)))
          if not self.drop_remainder:
            break  # masked out: an eval pass counts every readable example exactly once
          continue
        labels[slot - first] = self.labels[example]
        mask[slot - first] = True
        break
      else:
        raise CorruptImageError(f"{MAX_CONSECUTIVE_CORRUPT} consecutive images of the epoch "
                                f"order could not be decoded, the last {path}")
    return FillResult(first, labels, mask, corrupt, time.thread_time() - cpu)


class ThreadWorkers:
  """Workers as threads of this process; the batch buffers are ordinary arrays."""

  def __init__(self, filler: ExampleFiller, num_workers: int):
    self.filler = filler
    self.pool = concurrent.futures.ThreadPoolExecutor(num_workers,
                                                      thread_name_prefix="jaxring-data")

  def new_batch(self, batch_size: int) -> tuple[np.ndarray, int]:
    size = self.filler.image_size
    return np.zeros((batch_size, size, size, 3), np.uint8), -1

  def submit(self, image, ring_slot, first, stop, start, epoch, order):
    del ring_slot
    return self.pool.submit(self.filler.fill, image, first, stop, start, epoch, order)

  def release(self, ring_slot: int) -> None:
    del ring_slot

  def take(self, image: np.ndarray) -> np.ndarray:
    return image  # a fresh array per batch: nothing to copy

  def pids(self) -> list[int]:
    return []

  def close(self) -> None:
    self.pool.shutdown(wait=True, cancel_futures=True)


class _SharedArray:
  """An array in a file under /dev/shm (or the temp folder), mapped by name in every process."""

  def __init__(self, shape, dtype, path: str | None = None):
    self.owner = path is None
    if path is None:
      nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
      path = os.path.join(_shared_folder(nbytes),
                          f"jaxring-data-{os.getpid()}-{uuid.uuid4().hex[:12]}")
      np.lib.format.open_memmap(path, "w+", np.dtype(dtype), tuple(shape)).flush()
      self._finalizer = weakref.finalize(self, _unlink, path)
    self.path = path
    self.array = np.load(path, mmap_mode="r+")

  def unlink(self) -> None:
    if self.owner:
      self._finalizer()


def _shared_folder(nbytes: int) -> str:
  """/dev/shm where it has room (a container's is often 64 MiB, and a process touching a page of
  a full tmpfs dies of SIGBUS), else the temporary folder (the page cache holds it)."""
  try:
    stat = os.statvfs("/dev/shm")
    if stat.f_bavail * stat.f_frsize > nbytes + (64 << 20):
      return "/dev/shm"
  except OSError:
    pass
  return tempfile.gettempdir()


def _unlink(path: str) -> None:
  try:
    os.unlink(path)
  except FileNotFoundError:
    pass


def _shared_paths(paths: Sequence[str]) -> tuple[_SharedArray, _SharedArray]:
  encoded = [p.encode("utf-8", "surrogateescape") for p in paths]
  offsets = np.zeros(len(encoded) + 1, np.int64)
  np.cumsum([len(b) for b in encoded], out=offsets[1:])
  blob = _SharedArray((max(1, int(offsets[-1])),), np.uint8)
  blob.array[:offsets[-1]] = np.frombuffer(b"".join(encoded), np.uint8)
  table = _SharedArray(offsets.shape, np.int64)
  table.array[:] = offsets
  return blob, table


class _PathTable:
  """``paths[i]`` read from the shared blob of encoded paths."""

  def __init__(self, blob: np.ndarray, offsets: np.ndarray):
    self.blob, self.offsets = blob, offsets

  def __len__(self) -> int:
    return len(self.offsets) - 1

  def __getitem__(self, i: int) -> str:
    raw = self.blob[self.offsets[i]:self.offsets[i + 1]].tobytes()
    return raw.decode("utf-8", "surrogateescape")


_worker: dict = {}  # the state of this worker process (set by _init_worker)


def _init_worker(spec: dict) -> None:
  decode.limit_library_threads()
  arrays = {k: np.load(spec[k], mmap_mode="r+" if k == "ring" else "r")
            for k in ("ring", "blob", "offsets", "labels")}
  _worker.clear()
  _worker.update(arrays, orders={})
  _worker["filler"] = ExampleFiller(_PathTable(arrays["blob"], arrays["offsets"]),
                                    arrays["labels"], **spec["filler"])


def _run_task(ring_slot: int, first: int, stop: int, start: int, epoch: int) -> FillResult:
  filler: ExampleFiller = _worker["filler"]
  orders = _worker["orders"]
  if epoch not in orders:
    orders.clear()  # batches are filled in order: an older epoch is not asked for again
    orders[epoch] = epoch_order(filler.seed, epoch, filler.num_examples, filler.train)
  return filler.fill(_worker["ring"][ring_slot], first, stop, start, epoch, orders[epoch])


class ProcessWorkers:
  """Worker processes that decode into a ring of ``ring_size`` batch buffers in shared memory."""

  def __init__(self, paths: Sequence[str], labels: np.ndarray, *, num_workers: int,
               ring_size: int, batch_size: int, filler_args: dict):
    size = filler_args["image_size"]
    self._ring = _SharedArray((ring_size, batch_size, size, size, 3), np.uint8)
    self._blob, self._offsets = _shared_paths(paths)
    self._labels = _SharedArray((len(labels),), np.int32)
    self._labels.array[:] = labels
    spec = {"ring": self._ring.path, "blob": self._blob.path, "offsets": self._offsets.path,
            "labels": self._labels.path, "filler": filler_args}
    self._free = list(range(ring_size))
    self.pool = ProcessPool(num_workers, initializer=_init_worker, initargs=(spec,))
    # every process has mapped the files now: their names can go, so that a loader killed
    # without its atexit handlers (SIGTERM, SIGKILL) leaves nothing in /dev/shm
    self.pool.wait_ready()
    self._unlink()

  def new_batch(self, batch_size: int) -> tuple[np.ndarray, int]:
    if not self._free:
      raise RuntimeError("ImageLoader: no free batch buffer (more batches in flight than "
                         "prefetch + 1)")
    slot = self._free.pop(0)
    return self._ring.array[slot, :batch_size], slot

  def submit(self, image, ring_slot, first, stop, start, epoch, order):
    del image, order  # the worker maps the ring and computes the order itself
    return self.pool.submit(_run_task, ring_slot, first, stop, start, epoch)

  def release(self, ring_slot: int) -> None:
    self._free.append(ring_slot)

  def take(self, image: np.ndarray) -> np.ndarray:
    # the ring slot is reused for a later batch, while the caller may hold this one (or JAX may
    # still be reading it): the caller gets its own copy
    return np.array(image)

  def pids(self) -> list[int]:
    return [process.pid for process in self.pool.processes]

  def close(self) -> None:
    self.pool.shutdown()
    self._unlink()

  def _unlink(self) -> None:
    for shared in (self._ring, self._blob, self._offsets, self._labels):
      shared.unlink()
