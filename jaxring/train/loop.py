"""``fit``: one explicit training loop, readable top to bottom (big_vision's habit).

Resume from the newest checkpoint that restores intact (state and data position; a corrupt one is
logged, set aside and the previous one tried), step, log every ``log_every`` steps (progress bar +
JSON lines, process 0 only), raise on a non-finite loss, checkpoint every ``checkpoint_every``
steps and at the end.

Metrics stay on the devices between log points: reading a value forces the host to wait for the
step that produced it, and waiting every step would serialize dispatch with compute.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Iterator

import jax

from jaxring.train.checkpoint import CheckpointCorruptError, Checkpointer
from jaxring.train.metrics import JsonlWriter, Progress, to_python

log = logging.getLogger(__name__)


def _global_batch_size(batch) -> int:
  leaf = jax.tree_util.tree_leaves(batch)[0]
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    return int(leaf.shape[0])
  return int(leaf.shape[0]) * jax.process_count()  # per-process arrays


def _check_finite(record: dict) -> None:
  loss = record.get("loss")
  if isinstance(loss, str) or (isinstance(loss, float) and not math.isfinite(loss)):
    raise FloatingPointError(f"non-finite loss {loss} at step {record['step']}")


def fit(step: Callable, state: Any, batches: Iterator, *, num_steps: int,
        checkpointer: Checkpointer | None = None, checkpoint_every: int | None = None,
        log_every: int = 10, metrics_path: str | None = None, progress: bool = True) -> Any:
  """Trains until ``state.step == num_steps``, resuming from ``checkpointer`` if it holds a step.

  Args:
    step: a :func:`jaxring.train_step` (or any ``(state, batch) -> (state, metrics)``).
    state: the initial state; also the template a checkpoint is restored into.
    batches: an iterator of batches; with ``get_state``/``set_state`` (as
      :class:`~jaxring.train.BatchIterator`) its position is checkpointed and restored.
    num_steps: the step count to reach (not the number of steps to run).
    checkpointer: where to save and resume from; None: no checkpoints.
    checkpoint_every: save every this many steps (and always at the end).
    log_every: steps between metric reads (progress bar, JSON lines, finite-loss check).
    metrics_path: JSON lines file (one record per step: step, metrics, images_per_s).
    progress: show a tqdm bar.

  Returns:
    The final state.

  Raises:
    FloatingPointError: the loss became non-finite.
    CheckpointCorruptError: every committed checkpoint is corrupt (each one found corrupt is
      logged and renamed ``<step>.corrupt``; the newest intact one is resumed from).

  Example:
    >>> state = jaxring.train.fit(step, state, batches, num_steps=1000,
    ...                           checkpointer=jaxring.train.Checkpointer("/tmp/run1"),
    ...                           checkpoint_every=100, metrics_path="/tmp/run1/metrics.jsonl")
  """
  if hasattr(step, "prepare"):
    state = step.prepare(state)
  if checkpointer is not None and checkpointer.latest_step is not None:
    state, data_state = _resume(checkpointer, state)
    if data_state and hasattr(batches, "set_state"):
      batches.set_state(data_state)
  start = int(jax.device_get(state.step))
  writer = JsonlWriter(metrics_path)
  bar = Progress(total=num_steps, initial=start, enabled=progress)
  pending: list[tuple[int, Any, int]] = []
  last_saved = start
  tick, ticked = time.perf_counter(), start
  try:
    for done in range(start + 1, num_steps + 1):
      batch = next(batches)
      state, metrics = step(state, batch)
      pending.append((done, metrics, _global_batch_size(batch)))
      if done % log_every == 0 or done == num_steps:
        records = [dict(to_python(m), step=s) for s, m, _ in pending]  # waits for the steps
        now = time.perf_counter()
        rate = sum(n for _, _, n in pending) / max(now - tick, 1e-9)
        for record in records:
          record["images_per_s"] = rate
          writer.write(record)
        for record in records:
          _check_finite(record)
        bar.update(done - ticked, records[-1])
        pending, tick, ticked = [], now, done
      if checkpointer is not None and checkpoint_every and done % checkpoint_every == 0:
        checkpointer.save(state, data_state=_position(batches), step=done, force=True)
        last_saved = done
    if checkpointer is not None and last_saved != num_steps and num_steps > start:
      checkpointer.save(state, data_state=_position(batches), step=num_steps, force=True)
  finally:
    bar.close()
    writer.close()
    if checkpointer is not None:
      checkpointer.wait_until_finished()
  return state


def _resume(checkpointer: Checkpointer, template) -> tuple[Any, dict]:
  """Restores the newest intact checkpoint; corrupt ones are logged and set aside."""
  skipped = []
  for step in sorted(checkpointer.all_steps(), reverse=True):
    try:
      return checkpointer.restore(template, step=step)
    except CheckpointCorruptError as exc:
      # Set aside, not deleted: the next save of this step would collide with it, and whoever
      # investigates the corruption wants the files.
      moved = checkpointer.set_aside(step)
      log.warning("skipping checkpoint step %d at %s: %s (moved to %s); trying the previous one",
                  exc.step, exc.path, exc.reason, moved)
      skipped.append(exc)
  raise CheckpointCorruptError(
      skipped[-1].step, checkpointer.directory,
      "every committed checkpoint is corrupt: " + "; ".join(
          f"step {e.step}: {e.reason}" for e in skipped))


def _position(batches) -> dict:
  return batches.get_state() if hasattr(batches, "get_state") else {}
