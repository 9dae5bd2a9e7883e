"""``ImageLoader``: batches of decoded, augmented images from an ``ImageFolder``.

Decoding runs in worker processes by default (``worker_type="thread"``: threads of this process),
with libjpeg-turbo and OpenCV where they are installed (``decoder="turbo"``; ``"pil"``: Pillow).
:mod:`jaxring._src.data.workers` says why processes, :mod:`jaxring._src.data.decode` what one image
costs and why.

Why not grain (``grain`` 0.2.18 installs here for Python 3.11; re-checked when the loader became
the bottleneck of a GPU host, issue 20): its multiprocessing is the part we would want, and we
would still run our own decode in its workers, so it would not make an image cheaper; its
transforms return one array per record, which batching then copies into the batch (``np.stack``,
into shared memory under ``mp_prefetch``), where ours decode into the batch's slot. What it would
cost: its ``IndexSampler`` shards by giving each process a contiguous range of the records and
shuffles inside that range, so a process only ever sees its own fixed part of the data set and a
global batch depends on the process count; its iterator state is a JSON blob rather than two
integers; its last batch is short with no mask; and a corrupt image counted in a worker process
is not visible to the caller. This loader keeps :class:`jaxring.train.BatchIterator`'s contract
instead: each epoch's order is a permutation of the whole data set seeded by ``(seed, epoch)``,
every process takes its contiguous slice of each global batch, and the position is
``(epoch, index)``.

Every random choice of an example (crop, flip) comes from a generator seeded by
``(seed, epoch, example index)``, so a batch is a pure function of the position (and of the
decoder): it does not depend on the number or kind of workers, on their scheduling, or on whether
the run was resumed.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import weakref
from typing import Iterator

import jax
import numpy as np

from jaxring._src.data import decode, workers
from jaxring._src.data.folder import ImageFolder

log = logging.getLogger(__name__)
WORKER_TYPES = ("process", "thread")


def _available_cpus() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1


class _Batch:
  """The arrays of one batch being filled by the workers, and their futures."""

  def __init__(self, image: np.ndarray, ring_slot: int):
    self.image = image
    self.ring_slot = ring_slot
    self.futures: list[concurrent.futures.Future] = []


class ImageLoader:
  """Endless (or ``num_epochs``) batches of an :class:`ImageFolder`, decoded in worker processes.

  Args:
    dataset: the images and labels.
    global_batch_size: the batch size over all processes.
    train: shuffle every epoch and apply random-resized crop + flip; else the order of
      ``dataset`` and the eval transform (shorter side to ``image_size / 0.875``, center crop).
    image_size: the height and width of the images.
    seed: the seed of the shuffling and of the augmentation.
    process_index, process_count: which slice of each global batch this process yields
      (default: ``jax.process_index()`` / ``jax.process_count()``).
    num_workers: decoding workers (default: the CPUs this process may run on).
    worker_type: ``"process"`` (processes decoding into shared memory; scales with cores) or
      ``"thread"`` (threads of this process: no start-up, for small data and tests).
    decoder: ``"auto"`` (``"turbo"`` where simplejpeg and OpenCV import, else ``"pil"``),
      ``"turbo"`` (libjpeg-turbo + OpenCV; PIL for what it cannot read) or ``"pil"``.
    prefetch: batches decoded ahead of the one ``next`` returns.
    on_corrupt: ``"skip"``: log and count an undecodable file (``corrupt_count``) and fill its slot
      from the next example of the epoch's order, or where batches have a mask, leave it
      masked out; ``"raise"``: ``next`` raises :class:`CorruptImageError` naming the file.
    drop_remainder: drop the last incomplete global batch of each epoch. With False, the last
      batch is padded (zero images, label 0) and every batch carries a ``"mask"`` array that is
      True for real examples: an eval pass of ``batches_per_epoch`` batches (or ``num_epochs=1``)
      then sees every example exactly once over all processes.
    num_epochs: stop after this many epochs (``StopIteration``); None: endless.

  Batches are ``{"image": uint8 [global_batch_size // process_count, image_size, image_size, 3],
  "label": int32 [same]}``, plus ``"mask"`` (bool) when ``drop_remainder`` is False.

  Example:
    >>> train = ImageLoader(ImageFolder(root, "train"), 1024, train=True, seed=0)
    >>> batch = next(train)
    >>> position = train.get_state()  # {"epoch": 0, "index": 1, "seed": 0}
    >>> val = ImageLoader(ImageFolder(root, "val"), 1024, train=False, drop_remainder=False,
    ...                   num_epochs=1)
    >>> correct = sum(((predict(b["image"]) == b["label"]) & b["mask"]).sum() for b in val)
  """

  def __init__(self, dataset: ImageFolder, global_batch_size: int, *, train: bool,
               image_size: int = 224, seed: int = 0, process_index: int | None = None,
               process_count: int | None = None, num_workers: int | None = None,
               prefetch: int = 2, on_corrupt: str = "skip", drop_remainder: bool = True,
               num_epochs: int | None = None, worker_type: str = "process",
               decoder: str = "auto"):
    if on_corrupt not in ("skip", "raise"):
      raise ValueError(f"on_corrupt must be 'skip' or 'raise', got {on_corrupt!r}")
    if worker_type not in WORKER_TYPES:
      raise ValueError(f"worker_type must be one of {WORKER_TYPES}, got {worker_type!r}")
    self.decoder = decode.resolve_decoder(decoder)
    self.worker_type = worker_type
    self.process_count = jax.process_count() if process_count is None else int(process_count)
    self.process_index = jax.process_index() if process_index is None else int(process_index)
    if not 0 <= self.process_index < self.process_count:
      raise ValueError(f"process_index {self.process_index} is not in [0, {self.process_count})")
    if global_batch_size <= 0 or global_batch_size % self.process_count:
      raise ValueError(f"global_batch_size {global_batch_size} is not a positive multiple of "
                       f"{self.process_count} processes")
    self.num_examples = len(dataset)
    if drop_remainder and global_batch_size > self.num_examples:
      raise ValueError(f"global_batch_size {global_batch_size} exceeds the {self.num_examples} "
                       f"images of {dataset!r} (drop_remainder=True would yield no batch)")
    self.dataset = dataset
    self.global_batch_size = global_batch_size
    self.batch_size = global_batch_size // self.process_count
    self.train = train
    self.image_size = image_size
    self.seed = seed
    self.on_corrupt = on_corrupt
    self.drop_remainder = drop_remainder
    self.num_epochs = num_epochs
    self.prefetch = max(0, int(prefetch))
    self.num_workers = num_workers or _available_cpus()
    if drop_remainder:
      self.batches_per_epoch = self.num_examples // global_batch_size
    else:
      self.batches_per_epoch = -(-self.num_examples // global_batch_size)
    self.corrupt_files: set[str] = set()
    self.epoch, self.index = 0, 0
    self._orders: dict[int, np.ndarray] = {}
    self._pending: dict[tuple[int, int], _Batch] = {}
    self._workers: workers.ThreadWorkers | workers.ProcessWorkers | None = None
    #: CPU seconds the workers spent on the batches returned so far (all processes or threads)
    self.worker_cpu_seconds = 0.0
    # examples per task: a few tasks per worker and batch balance the load; one task per image
    # would spend ~10% of a 64 px decode in a thread pool, more in a process pool (a task's
    # arguments and result cross a pipe: a round trip measured 0.14 ms)
    tasks = 4 if worker_type == "thread" else 2
    self._chunk = max(1, self.batch_size // (tasks * self.num_workers))

  @property
  def num_classes(self) -> int:
    return self.dataset.num_classes

  @property
  def corrupt_count(self) -> int:
    """The number of distinct undecodable files met so far (by this process)."""
    return len(self.corrupt_files)

  def worker_pids(self) -> list[int]:
    """The process ids of the worker processes (none for thread workers or before the first
    batch), e.g. to read their CPU time."""
    return self._workers.pids() if self._workers is not None else []

  def epoch_order(self, epoch: int) -> np.ndarray:
    """The example indices of ``epoch`` in the order the global batches take them."""
    order = self._orders.get(epoch)
    if order is None:
      order = workers.epoch_order(self.seed, epoch, self.num_examples, self.train)
      self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
      self._orders[epoch] = order
    return order

  def example_indices(self, epoch: int, index: int) -> np.ndarray:
    """The example indices of this process's part of batch ``index`` of ``epoch`` (-1: padding)."""
    start = index * self.global_batch_size + self.process_index * self.batch_size
    positions = np.arange(start, start + self.batch_size)
    order = self.epoch_order(epoch)
    return np.where(positions < self.num_examples,
                    order[np.minimum(positions, self.num_examples - 1)], -1)

  def __iter__(self) -> Iterator[dict]:
    return self

  def __next__(self) -> dict:
    if self.num_epochs is not None and self.epoch >= self.num_epochs:
      raise StopIteration
    key = (self.epoch, self.index)
    self._submit_ahead(key)
    batch = self._pending.pop(key)
    label = np.zeros(self.batch_size, np.int32)
    mask = np.zeros(self.batch_size, np.bool_)
    try:
      for future in batch.futures:
        # re-raises a worker's error (CorruptImageError with on_corrupt="raise")
        result: workers.FillResult = future.result()
        stop = result.first + len(result.labels)
        label[result.first:stop], mask[result.first:stop] = result.labels, result.mask
        self.worker_cpu_seconds += result.cpu_seconds
        for path, message in result.corrupt:
          if path not in self.corrupt_files:
            self.corrupt_files.add(path)
            log.warning("skipping the undecodable image %s: %s", path, message)
      image = self._workers.take(batch.image)
    finally:
      self._release(batch)
    self.epoch, self.index = self._successor(key)
    self._submit_ahead((self.epoch, self.index))
    out = {"image": image, "label": label}
    if not self.drop_remainder:
      out["mask"] = mask
    return out

  def get_state(self) -> dict:
    """The position: the next batch is batch ``index`` of epoch ``epoch``."""
    return {"epoch": int(self.epoch), "index": int(self.index), "seed": int(self.seed)}

  def set_state(self, state: dict) -> None:
    """Resumes at ``state`` (from :meth:`get_state`); batches prefetched so far are discarded."""
    if int(state.get("seed", self.seed)) != self.seed:
      raise ValueError(f"ImageLoader: the saved position is for seed {state['seed']}, this loader "
                       f"has seed {self.seed}")
    epoch, index = int(state["epoch"]), int(state["index"])
    if not 0 <= index <= self.batches_per_epoch:
      raise ValueError(f"ImageLoader: batch index {index} is outside an epoch of "
                       f"{self.batches_per_epoch} batches")
    self._cancel_pending()
    self.epoch, self.index = (epoch + 1, 0) if index == self.batches_per_epoch else (epoch, index)

  def close(self) -> None:
    """Stops the workers and frees their shared memory (also done when the loader is garbage
    collected, and at interpreter exit)."""
    self._cancel_pending()
    if self._workers is not None:
      self._close_workers()
      self._workers = None

  def __enter__(self) -> ImageLoader:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _successor(self, key: tuple[int, int]) -> tuple[int, int]:
    epoch, index = key
    return (epoch + 1, 0) if index + 1 >= self.batches_per_epoch else (epoch, index + 1)

  def _release(self, batch: _Batch) -> None:
    if batch.ring_slot >= 0:
      # a task that already runs still writes into its buffer: wait before it is reused
      concurrent.futures.wait(batch.futures)
      self._workers.release(batch.ring_slot)
      batch.ring_slot = -1

  def _cancel_pending(self) -> None:
    for batch in self._pending.values():
      for future in batch.futures:
        future.cancel()
    for batch in self._pending.values():
      self._release(batch)
    self._pending.clear()

  def _start_workers(self) -> None:
    filler_args = dict(train=self.train, image_size=self.image_size, seed=self.seed,
                       drop_remainder=self.drop_remainder, on_corrupt=self.on_corrupt,
                       decoder=self.decoder)
    if self.worker_type == "thread":
      filler = workers.ExampleFiller(self.dataset.paths, self.dataset.labels, **filler_args)
      self._workers = workers.ThreadWorkers(filler, self.num_workers)
    else:
      self._workers = workers.ProcessWorkers(
          self.dataset.paths, self.dataset.labels, num_workers=self.num_workers,
          ring_size=self.prefetch + 1, batch_size=self.batch_size, filler_args=filler_args)
    # a loader dropped without close() must not leave its worker processes behind; the
    # finalizer holds the workers, not the loader
    self._close_workers = weakref.finalize(self, self._workers.close)

  def _submit_ahead(self, key: tuple[int, int]) -> None:
    if self._workers is None:
      self._start_workers()
    for _ in range(self.prefetch + 1):
      if self.num_epochs is not None and key[0] >= self.num_epochs:
        return
      if key not in self._pending:
        self._pending[key] = self._submit(*key)
      key = self._successor(key)

  def _submit(self, epoch: int, index: int) -> _Batch:
    batch = _Batch(*self._workers.new_batch(self.batch_size))
    start = index * self.global_batch_size + self.process_index * self.batch_size
    order = self.epoch_order(epoch)  # here, not in the workers: the cache is not thread-safe
    for first in range(0, self.batch_size, self._chunk):
      stop = min(first + self._chunk, self.batch_size)
      batch.futures.append(self._workers.submit(batch.image, batch.ring_slot, first, stop, start,
                                                epoch, order))
    return batch
