"""``ImageLoader``: batches of decoded, augmented images from an ``ImageFolder``.

Decoding runs in a thread pool. Pillow releases the GIL while libjpeg decodes and while it
resamples, and those two are nearly all of the per-image time (the Python around them is ~5%),
so threads scale with cores without copying every batch between processes; they also keep one
``corrupt_count`` and propagate a decode error, naming its file, to the caller of ``next``.

Why not grain (checked: ``grain`` 0.2.18 installs here for Python 3.11): its ``IndexSampler``
shards by giving each process a contiguous range of the records and shuffles inside that range,
so a process only ever sees its own fixed part of the data set and a global batch depends on the
process count; its iterator state is a JSON blob rather than two integers; its last batch is short
with no mask; and a corrupt image counted in a worker process is not visible to the caller. This
loader keeps :class:`jaxring.train.BatchIterator`'s contract instead: each epoch's order is a
permutation of the whole data set seeded by ``(seed, epoch)``, every process takes its contiguous
slice of each global batch, and the position is ``(epoch, index)``.

Every random choice of an example (crop, flip) comes from a generator seeded by
``(seed, epoch, example index)``, so a batch is a pure function of the position: it does not
depend on the number of workers, on their scheduling, or on whether the run was resumed.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Iterator

import jax
import numpy as np

from jaxring._src.data.folder import ImageFolder
from jaxring._src.data.transforms import CorruptImageError, load_image

log = logging.getLogger(__name__)
# A run of this many corrupt files in a row means the data set is broken, not one file.
_MAX_CONSECUTIVE_CORRUPT = 64


def _available_cpus() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1


class _Batch:
  """The arrays of one batch being filled by the workers, and their futures."""

  def __init__(self, size: int, image_size: int):
    self.image = np.zeros((size, image_size, image_size, 3), np.uint8)
    self.label = np.zeros((size,), np.int32)
    self.mask = np.zeros((size,), np.bool_)
    self.futures: list[concurrent.futures.Future] = []


class ImageLoader:
  """Endless (or ``num_epochs``) batches of an :class:`ImageFolder`, decoded in worker threads.

  Args:
    dataset: the images and labels.
    global_batch_size: the batch size over all processes.
    train: shuffle every epoch and apply random-resized crop + flip; else the order of
      ``dataset`` and the eval transform (shorter side to ``image_size / 0.875``, center crop).
    image_size: the height and width of the images.
    seed: the seed of the shuffling and of the augmentation.
    process_index, process_count: which slice of each global batch this process yields
      (default: ``jax.process_index()`` / ``jax.process_count()``).
    num_workers: decoding threads (default: the CPUs this process may run on).
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
               num_epochs: int | None = None):
    if on_corrupt not in ("skip", "raise"):
      raise ValueError(f"on_corrupt must be 'skip' or 'raise', got {on_corrupt!r}")
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
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    # examples per task: a few tasks per worker and batch balance the load; one task per image
    # would spend ~10% of a 64 px decode in the executor
    self._chunk = max(1, self.batch_size // (4 * self.num_workers))

  @property
  def num_classes(self) -> int:
    return self.dataset.num_classes

  @property
  def corrupt_count(self) -> int:
    """The number of distinct undecodable files met so far (by this process)."""
    return len(self.corrupt_files)

  def epoch_order(self, epoch: int) -> np.ndarray:
    """The example indices of ``epoch`` in the order the global batches take them."""
    order = self._orders.get(epoch)
    if order is None:
      if self.train:
        order = np.random.default_rng((self.seed, epoch)).permutation(self.num_examples)
      else:
        order = np.arange(self.num_examples)
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
    for future in batch.futures:
      future.result()  # re-raises a worker's error (CorruptImageError with on_corrupt="raise")
    self.epoch, self.index = self._successor(key)
    self._submit_ahead((self.epoch, self.index))
    out = {"image": batch.image, "label": batch.label}
    if not self.drop_remainder:
      out["mask"] = batch.mask
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
    """Stops the worker threads (also done at interpreter exit)."""
    self._cancel_pending()
    if self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None

  def __enter__(self) -> ImageLoader:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _successor(self, key: tuple[int, int]) -> tuple[int, int]:
    epoch, index = key
    return (epoch + 1, 0) if index + 1 >= self.batches_per_epoch else (epoch, index + 1)

  def _cancel_pending(self) -> None:
    for batch in self._pending.values():
      for future in batch.futures:
        future.cancel()
    self._pending.clear()

  def _submit_ahead(self, key: tuple[int, int]) -> None:
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(self.num_workers,
                                                         thread_name_prefix="jaxring-data")
    for _ in range(self.prefetch + 1):
      if self.num_epochs is not None and key[0] >= self.num_epochs:
        return
      if key not in self._pending:
        self._pending[key] = self._submit(*key)
      key = self._successor(key)

  def _submit(self, epoch: int, index: int) -> _Batch:
    batch = _Batch(self.batch_size, self.image_size)
    start = index * self.global_batch_size + self.process_index * self.batch_size
    order = self.epoch_order(epoch)  # here, not in the workers: the cache is not thread-safe
    for slot in range(0, self.batch_size, self._chunk):
      slots = range(slot, min(slot + self._chunk, self.batch_size))
      batch.futures.append(self._pool.submit(self._fill, batch, slots, start, epoch, order))
    return batch

  def _fill(self, batch: _Batch, slots: range, start: int, epoch: int, order: np.ndarray) -> None:
    for slot in slots:
      position = start + slot
      if position >= self.num_examples:
        continue  # padding of the last batch: zeros, masked out
      for attempt in range(_MAX_CONSECUTIVE_CORRUPT):
        example = int(order[(position + attempt) % self.num_examples])
        path = self.dataset.paths[example]
        rng = np.random.default_rng((self.seed, epoch, example)) if self.train else None
        try:
          batch.image[slot] = load_image(path, self.image_size, train=self.train, rng=rng)
        except CorruptImageError:
          if self.on_corrupt == "raise":
            raise
          if path not in self.corrupt_files:
            self.corrupt_files.add(path)
            log.warning("skipping the undecodable image %s", path, exc_info=True)
          if not self.drop_remainder:
            break  # masked out: an eval pass counts every readable example exactly once
          continue  # refill the slot from the next example in the order
        batch.label[slot] = self.dataset.labels[example]
        batch.mask[slot] = True
        break
      else:
        raise CorruptImageError(f"{_MAX_CONSECUTIVE_CORRUPT} consecutive images of the epoch "
                                f"order could not be decoded, the last {path}")
