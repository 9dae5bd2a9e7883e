"""A checkpointable batch iterator over in-memory arrays.

Its position is two integers (epoch, batch index) and each epoch's order is a pure function of
``(seed, epoch)``, so ``get_state()`` saved with a checkpoint and ``set_state()`` after a restart
yield exactly the batches an uninterrupted run would have seen. With several processes, each
process yields its own contiguous slice of every global batch (the layout
``jax.make_array_from_process_local_data`` expects).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np


class BatchIterator:
  """Endless shuffled batches of a pytree of arrays (leading axis: examples).

  Args:
    data: pytree of arrays with the same leading size.
    batch_size: global batch size (over all processes).
    seed: the shuffling seed; epoch ``e`` uses the permutation seeded by ``(seed, e)``.
    shuffle: shuffle every epoch (else the stored order).
    process_index, process_count: which slice of each global batch this process yields
      (default: ``jax.process_index()``/``jax.process_count()``).

  Example:
    >>> batches = jaxring.train.BatchIterator({"x": x, "y": y}, batch_size=256, seed=0)
    >>> batch = next(batches)
    >>> position = batches.get_state()  # {"epoch": 0, "index": 1}
  """

  def __init__(self, data: Any, batch_size: int, *, seed: int = 0, shuffle: bool = True,
               process_index: int | None = None, process_count: int | None = None):
    self._leaves, self._treedef = jax.tree_util.tree_flatten(data)
    sizes = {int(np.shape(l)[0]) for l in self._leaves}
    if len(sizes) != 1:
      raise ValueError(f"BatchIterator: leaves have different leading sizes {sorted(sizes)}")
    self.num_examples = sizes.pop()
    self.process_count = jax.process_count() if process_count is None else process_count
    self.process_index = jax.process_index() if process_index is None else process_index
    if batch_size % self.process_count:
      raise ValueError(f"batch_size {batch_size} is not divisible by {self.process_count} "
                       "processes")
    if batch_size > self.num_examples:
      raise ValueError(f"batch_size {batch_size} exceeds the {self.num_examples} examples")
    self.batch_size = batch_size
    self.seed = seed
    self.shuffle = shuffle
    self.batches_per_epoch = self.num_examples // batch_size  # the remainder is dropped
    self.epoch = 0
    self.index = 0
    self._order = self._epoch_order(0)

  def _epoch_order(self, epoch: int) -> np.ndarray:
    if not self.shuffle:
      return np.arange(self.num_examples)
    return np.random.default_rng((self.seed, epoch)).permutation(self.num_examples)

  def __iter__(self) -> BatchIterator:
    return self

  def __next__(self):
    if self.index >= self.batches_per_epoch:
      self.epoch, self.index = self.epoch + 1, 0
      self._order = self._epoch_order(self.epoch)
    per_process = self.batch_size // self.process_count
    start = self.index * self.batch_size
    # sorted (gathers in memory order), then cut: the global batch, and which replica gets which
    # example, do not depend on the number of processes
    batch = np.sort(self._order[start:start + self.batch_size])
    idx = batch[self.process_index * per_process:(self.process_index + 1) * per_process]
    self.index += 1
    return jax.tree_util.tree_unflatten(self._treedef, [np.asarray(l)[idx] for l in self._leaves])

  def get_state(self) -> dict:
    """The position: the next batch is batch ``index`` of epoch ``epoch``."""
    return {"epoch": int(self.epoch), "index": int(self.index), "seed": int(self.seed)}

  def set_state(self, state: dict) -> None:
    if state.get("seed", self.seed) != self.seed:
      raise ValueError(f"BatchIterator: the saved position is for seed {state['seed']}, "
                       f"this iterator has seed {self.seed}")
    self.epoch, self.index = int(state["epoch"]), int(state["index"])
    self._order = self._epoch_order(self.epoch)
