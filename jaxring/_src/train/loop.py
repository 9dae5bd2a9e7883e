"""``fit``: one explicit training loop, readable top to bottom (big_vision's habit).

Resume from the newest checkpoint that restores intact (state and data position; a corrupt one is
logged, set aside and the previous one tried), step, log every ``log_every`` steps (progress bar +
JSON lines, process 0 only), raise on a non-finite loss, evaluate every ``eval_every`` steps and
at the end, checkpoint every ``checkpoint_every`` steps and at the end. The recipes' training
(``recipes/train.py``) is this loop with an evaluation and ``steady_state=True``.

Metrics stay on the devices between log points: reading a value forces the host to wait for the
step that produced it, and waiting every step would serialize dispatch with compute.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any, Callable, Iterator

import jax

from jaxring._src.train import nnx_step
from jaxring._src.train.checkpoint import CheckpointCorruptError, Checkpointer
from jaxring._src.train.metrics import JsonlWriter, Progress, Throughput, to_python

log = logging.getLogger(__name__)


@dataclasses.dataclass
class FitSummary:
  """What a :func:`fit` run measured, filled in by ``fit(..., summary=FitSummary())``.

  Attributes:
    start_step: the step resumed from (0 for a fresh run).
    last_eval: the last ``evaluate`` result, with its ``step``; None without ``evaluate``.
    images_per_s: examples per second over the logged steps (with ``steady_state``: compilation,
      evaluation and checkpointing left out).
    compile_s: seconds of the first step (``steady_state`` only).
  """

  start_step: int = 0
  last_eval: dict | None = None
  images_per_s: float | None = None
  compile_s: float | None = None


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
        log_every: int = 10, metrics_path: str | None = None, progress: bool = True,
        evaluate: Callable[[Any], dict] | None = None, eval_every: int | None = None,
        steady_state: bool = False, summary: FitSummary | None = None) -> Any:
  """Trains until ``state.step == num_steps``, resuming from ``checkpointer`` if it holds a step.

  Args:
    step: a :func:`jaxring.train_step` (or any ``(state, batch) -> (state, metrics)``).
    state: the initial state; also the template a checkpoint is restored into. NNX: the
      objects, e.g. ``(model, optimizer)``, stepped in place as ``step(model, optimizer, batch)``
      (which returns the metrics) and returned.
    batches: an iterator of batches; with ``get_state``/``set_state`` (as
      :class:`~jaxring.train.BatchIterator`) its position is checkpointed and restored.
    num_steps: the step count to reach (not the number of steps to run).
    checkpointer: where to save and resume from; None: no checkpoints.
    checkpoint_every: save every this many steps (and always at the end).
    log_every: steps between metric reads (progress bar, JSON lines, finite-loss check).
    metrics_path: JSON lines file (one record per step: step, metrics, images_per_s; and one per
      evaluation: its result and step).
    progress: show a tqdm bar.
    evaluate: ``state -> dict`` of metrics, called by every process every ``eval_every`` steps
      and after the last (also when a resumed run has no step left).
    eval_every: steps between evaluations; None or 0: at the end only.
    steady_state: the first step (which compiles) is timed on its own (``summary.compile_s``) and
      its metrics are not logged, and evaluation and checkpoint time are left out of
      ``images_per_s``; otherwise every step is logged and timed.
    summary: a :class:`FitSummary` to fill in.

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
  summary = FitSummary() if summary is None else summary
  objs = nnx_step.objects(state)   # NNX: (model, optimizer), stepped in place
  if hasattr(step, "prepare"):
    state = step.prepare(*objs) if objs else step.prepare(state)
  if checkpointer is not None and checkpointer.latest_step is not None:
    state, data_state = _resume(checkpointer, state)
    if data_state and hasattr(batches, "set_state"):
      batches.set_state(data_state)
  start = summary.start_step = (nnx_step.step_count(objs) if objs else
                                int(jax.device_get(state.step)))
  writer = JsonlWriter(metrics_path)
  bar = Progress(total=num_steps, initial=start, enabled=progress)
  pending: list[tuple[int, Any, int]] = []
  last_saved, shown = start, start
  meter = Throughput()
  try:
    for done in range(start + 1, num_steps + 1):
      batch = next(batches)
      state, metrics = (state, step(*objs, batch)) if objs else step(state, batch)
      pending.append((done, metrics, _global_batch_size(batch)))
      if steady_state and done == start + 1:  # the compiling step: timed and dropped
        jax.block_until_ready(metrics)
        meter.first_step_done()
        pending = []
      if pending and (done % log_every == 0 or done == num_steps):
        _log_pending(pending, meter, writer, bar, done - shown)
        pending, shown = [], done
      at_eval = evaluate is not None and (done == num_steps or (eval_every and
                                                                done % eval_every == 0))
      at_save = checkpointer is not None and (
          (checkpoint_every and done % checkpoint_every == 0) or
          (done == num_steps and last_saved != num_steps))
      if at_eval or at_save:
        with meter.paused(state) if steady_state else contextlib.nullcontext():
          if at_eval:
            summary.last_eval = dict(evaluate(state), step=done)
            writer.write(summary.last_eval)
          if at_save:
            checkpointer.save(state, data_state=_position(batches), step=done, force=True)
            last_saved = done
    if evaluate is not None and summary.last_eval is None:  # resumed at the last step
      summary.last_eval = dict(evaluate(state), step=start)
  finally:
    bar.close()
    writer.close()
    if checkpointer is not None:
      checkpointer.wait_until_finished()
  summary.images_per_s, summary.compile_s = meter.examples_per_s, meter.compile_s
  return state


def _log_pending(pending: list, meter: Throughput, writer: JsonlWriter, bar: Progress,
                 steps: int) -> None:
  """Reads the pending steps' metrics (waiting for them), writes and checks them, moves the bar."""
  records = [dict(to_python(m), step=s) for s, m, _ in pending]
  rate = meter.add(sum(n for _, _, n in pending))
  for record in records:
    record["images_per_s"] = rate
    writer.write(record)
  for record in records:
    _check_finite(record)
  bar.update(steps, records[-1])


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
