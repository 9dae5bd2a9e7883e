"""``prefetch_to_device``: keep the next batches' host-to-device copies in flight.

``jax.device_put`` and ``jax.make_array_from_process_local_data`` return before the copy ends, so
putting ``size`` batches ahead overlaps their transfer with the steps that come before them.
The wrapper forwards ``get_state``/``set_state``, reporting the position after the batch it last
RETURNED (not the ones it holds ahead), so a checkpoint taken through it resumes exactly.
"""
from __future__ import annotations

import collections
from typing import Any, Iterator

import jax


class DevicePrefetcher:
  """The iterator :func:`prefetch_to_device` returns."""

  def __init__(self, iterator: Iterator, size: int = 2,
               sharding: jax.sharding.Sharding | None = None):
    if size < 1:
      raise ValueError(f"prefetch_to_device: size must be >= 1, got {size}")
    self.iterator = iterator
    self.size = size
    self.sharding = sharding
    self._queue: collections.deque = collections.deque()
    self._state: dict | None = None

  def _put(self, batch: Any) -> Any:
    if self.sharding is None:
      return jax.device_put(batch)
    return jax.tree_util.tree_map(
        lambda x: jax.make_array_from_process_local_data(self.sharding, x), batch)

  def _fill(self) -> None:
    while len(self._queue) < self.size:
      try:
        batch = next(self.iterator)
      except StopIteration:
        return
      self._queue.append((self._put(batch), self._position()))

  def _position(self) -> dict | None:
    return self.iterator.get_state() if hasattr(self.iterator, "get_state") else None

  def __iter__(self) -> DevicePrefetcher:
    return self

  def __next__(self) -> Any:
    if self._state is None:
      self._state = self._position()
    self._fill()
    if not self._queue:
      raise StopIteration
    batch, self._state = self._queue.popleft()
    self._fill()
    return batch

  def get_state(self) -> dict:
    """The wrapped iterator's position after the last batch returned here."""
    return self._position() if self._state is None else dict(self._state)

  def set_state(self, state: dict) -> None:
    self._queue.clear()
    self.iterator.set_state(state)
    self._state = dict(state)

  def __getattr__(self, name: str) -> Any:  # corrupt_count, batches_per_epoch, num_classes...
    if name == "iterator":
      raise AttributeError(name)
    return getattr(self.iterator, name)


def prefetch_to_device(iterator: Iterator, size: int = 2,
                       sharding: jax.sharding.Sharding | None = None) -> DevicePrefetcher:
  """Puts each batch (a pytree of host arrays) on the devices ``size`` batches ahead.

  Args:
    iterator: yields per-process batches (as :class:`ImageLoader` does).
    size: batches held on the devices ahead of the one returned.
    sharding: if given, every leaf becomes one global array
      (``jax.make_array_from_process_local_data(sharding, leaf)``), e.g.
      ``NamedSharding(mesh, P("data"))``; else ``jax.device_put`` to the default device.

  Returns:
    An iterator of device batches with the wrapped iterator's ``get_state``/``set_state``
    and attributes.

  Example:
    >>> sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    >>> batches = prefetch_to_device(ImageLoader(ds, 1024, train=True), 2, sharding)
    >>> next(batches)["image"].sharding == sharding
    True
  """
  return DevicePrefetcher(iterator, size, sharding)
