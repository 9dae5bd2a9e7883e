"""``SyntheticImages``: batches of random images without disk or decoding (``--data synthetic``).

It measures the training step's throughput without the input pipeline, so a batch must cost
close to nothing: the images are views into a pool of random pixels made once (read-only), and
only the labels are drawn per batch. Its position and sharding follow :class:`ImageLoader`.
"""
from __future__ import annotations

from typing import Iterator

import jax
import numpy as np

IMAGENET_TRAIN_IMAGES = 1_281_167


class SyntheticImages:
  """Endless batches ``{"image": uint8 [B, S, S, 3], "label": int32 [B]}``, B the per-process size.

  Args:
    global_batch_size: the batch size over all processes.
    image_size: the images' height and width.
    num_classes: labels are uniform in ``[0, num_classes)``.
    seed: the seed of the pixels and of the labels.
    process_index, process_count: which slice of each global batch this process yields.
    num_examples: the size of an "epoch" (positions and ``batches_per_epoch``, as ImageNet's).

  Example:
    >>> batches = SyntheticImages(1024, image_size=224, num_classes=1000)
    >>> next(batches)["image"].shape  # one process
    (1024, 224, 224, 3)
  """

  def __init__(self, global_batch_size: int, *, image_size: int = 224, num_classes: int = 1000,
               seed: int = 0, process_index: int | None = None, process_count: int | None = None,
               num_examples: int = IMAGENET_TRAIN_IMAGES):
    self.process_count = jax.process_count() if process_count is None else int(process_count)
    self.process_index = jax.process_index() if process_index is None else int(process_index)
    if global_batch_size <= 0 or global_batch_size % self.process_count:
      raise ValueError(f"global_batch_size {global_batch_size} is not a positive multiple of "
                       f"{self.process_count} processes")
    self.global_batch_size = global_batch_size
    self.batch_size = global_batch_size // self.process_count
    self.image_size = image_size
    self.num_classes = num_classes
    self.seed = seed
    self.num_examples = num_examples
    self.batches_per_epoch = max(1, num_examples // global_batch_size)
    self.corrupt_count = 0
    self.epoch, self.index = 0, 0
    rng = np.random.default_rng((seed, self.process_index))
    self._pool = rng.integers(0, 256, (2 * self.batch_size, image_size, image_size, 3), np.uint8)
    self._pool.flags.writeable = False

  def __iter__(self) -> Iterator[dict]:
    return self

  def __next__(self) -> dict:
    step = self.epoch * self.batches_per_epoch + self.index
    labels = np.random.default_rng((self.seed, self.epoch, self.index)).integers(
        0, self.num_classes, self.global_batch_size, dtype=np.int32)
    offset = (step * 7919) % self.batch_size  # different views, no copy
    start = self.process_index * self.batch_size
    self.index += 1
    if self.index >= self.batches_per_epoch:
      self.epoch, self.index = self.epoch + 1, 0
    return {"image": self._pool[offset:offset + self.batch_size],
            "label": labels[start:start + self.batch_size]}

  def get_state(self) -> dict:
    return {"epoch": int(self.epoch), "index": int(self.index), "seed": int(self.seed)}

  def set_state(self, state: dict) -> None:
    if int(state.get("seed", self.seed)) != self.seed:
      raise ValueError(f"SyntheticImages: the saved position is for seed {state['seed']}, this "
                       f"iterator has seed {self.seed}")
    self.epoch, self.index = int(state["epoch"]), int(state["index"])
