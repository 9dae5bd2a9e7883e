"""Checkpoints of a train state and the data position, with orbax's ``CheckpointManager``.

What makes a resumed run bit-identical to an uninterrupted one is saving *everything* the next step
reads: parameters, optimizer state, step, RNG key, BatchNorm statistics, the loss scale, each
replica's error-feedback residuals (sharded arrays: every replica's own) and the data iterator's
position (JSON). Restoring into a template state puts each array back with the template's sharding.

A save is atomic: orbax writes into ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>``
only after every file is written (the rename is atomic on POSIX file systems), so a crash in the
middle of a save leaves a temporary directory that is never read (and is removed on the next
start), and the last committed checkpoint is intact. ``max_to_keep`` deletes older steps only after
a newer one has been committed.
"""
from __future__ import annotations

import os
from typing import Any

import jax


def _ocp():
  import orbax.checkpoint as ocp  # ~0.4 s: only when checkpoints are used, not on `import jaxring`
  return ocp


def _abstract(x):
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return x


class Checkpointer:
  """Saves and restores ``(state, data_state)`` under ``directory``, keeping the newest few.

  Args:
    directory: where step folders are written (created if missing).
    max_to_keep: committed checkpoints kept; older ones are deleted after a newer commit.
    save_every: :meth:`save` is a no-op on steps that are not multiples of it (unless forced).
    async_save: write in a background thread once the arrays are copied off the devices;
      :meth:`wait_until_finished` (or :meth:`close`) waits for the commit.

  Example:
    >>> ckpt = jaxring.train.Checkpointer("/tmp/run1", max_to_keep=3)
    >>> ckpt.save(state, data_state=batches.get_state())
    >>> state, data_state = ckpt.restore(step.prepare(fresh_state))  # the latest step
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
               save_every: int = 1, async_save: bool = True):
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_every, create=True,
        cleanup_tmp_directories=True, enable_async_checkpointing=async_save)
    self.directory = os.fspath(os.path.abspath(directory))
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, state, *, data_state: dict | None = None, step: int | None = None,
           force: bool = False) -> bool:
    """Saves ``state`` (and the data position) as ``step`` (default ``state.step``).

    Returns:
      Whether a save was started (``save_every`` may skip it).
    """
    if step is None:
      step = int(jax.device_get(state.step))
    ocp = _ocp()
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              data=ocp.args.JsonSave(dict(data_state or {})))
    return self._manager.save(step, args=args, force=force)

  @property
  def latest_step(self) -> int | None:
    """The newest committed step (a save still in progress or interrupted does not count)."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def restore(self, template, *, step: int | None = None) -> tuple[Any, dict]:
    """Reads ``step`` (default: the latest) into arrays shaped and sharded like ``template``.

    Returns:
      ``(state, data_state)``; ``data_state`` is ``{}`` when none was saved.
    """
    if step is None:
      step = self.latest_step
    if step is None:
      raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
    abstract = jax.tree_util.tree_map(_abstract, template)
    ocp = _ocp()
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
    return restored["state"], dict(restored["data"] or {})

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
