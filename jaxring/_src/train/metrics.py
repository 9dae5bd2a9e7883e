"""Metrics out of a training run: JSON lines on disk and a progress bar, from process 0 only.

Every process computes the same (all-reduced) metrics; if each wrote them, a multi-process run would
write every line N times and draw N progress bars over each other (big_vision's habit: only process
0 writes).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import Any

import jax
import numpy as np


def _scalar(x) -> Any:
  a = np.asarray(x)
  if a.size == 1:
    v = a.reshape(()).item()
    return v if not isinstance(v, float) or math.isfinite(v) else str(v)
  return a.tolist()


def _fetch(x):
  """``x`` on the host; a value each process holds a part of (DiLoCo's per-node metrics) is
  gathered from every process (collective: every process logs the same steps)."""
  if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.device_get(x)


def to_python(metrics: dict) -> dict:
  """Device scalars -> JSON-friendly Python numbers (``inf``/``nan`` as strings)."""
  return {k: _scalar(_fetch(v)) for k, v in metrics.items()}


class JsonlWriter:
  """Appends one JSON object per call to ``path`` (process 0 only; elsewhere a no-op).

  Example:
    >>> with jaxring.train.JsonlWriter("/tmp/run1/metrics.jsonl") as w:
    ...   w.write({"step": 10, "loss": 0.5})
  """

  def __init__(self, path: str | os.PathLike | None):
    self.path = None if path is None else os.fspath(path)
    self._file = None
    if self.path is not None and jax.process_index() == 0:
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      self._file = open(self.path, "a", encoding="utf-8")

  def write(self, record: dict) -> None:
    if self._file is None:
      return
    self._file.write(json.dumps(record, sort_keys=True) + "\n")
    self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None

  def __enter__(self) -> JsonlWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class Progress:
  """A tqdm bar over steps with loss and examples/s (process 0 only; elsewhere a no-op).

  Example:
    >>> bar = jaxring.train.Progress(total=1000, initial=0)
    >>> bar.update(10, {"loss": 0.5, "images_per_s": 1234.0})
  """

  def __init__(self, total: int, initial: int = 0, enabled: bool = True):
    self._bar = None
    if enabled and jax.process_index() == 0:
      from tqdm.auto import tqdm
      self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

  def update(self, steps: int, record: dict) -> None:
    if self._bar is None:
      return
    shown = {}
    for key, fmt in (("loss", "{:.4g}"), ("images_per_s", "{:.1f}")):
      if isinstance(record.get(key), (int, float)):
        shown["img/s" if key == "images_per_s" else key] = fmt.format(record[key])
    self._bar.set_postfix(shown, refresh=False)
    self._bar.update(steps)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None


class Throughput:
  """Examples per second of the training steps: per log interval and over the run.

  ``first_step_done()`` keeps the first (compiling) step out and records its time as
  ``compile_s``; ``paused(state)`` keeps evaluation and checkpointing out.

  Example:
    >>> meter = Throughput()
    >>> state, metrics = step(state, batch); jax.block_until_ready(metrics)
    >>> meter.first_step_done()
    >>> ...; meter.add(10 * 256)  # 10 steps of 256 images since: their images/s
  """

  def __init__(self):
    self.compile_s: float | None = None
    self.examples, self.seconds = 0, 0.0
    self._tick = time.perf_counter()

  def first_step_done(self) -> None:
    now = time.perf_counter()
    self.compile_s, self._tick = now - self._tick, now

  def add(self, examples: int) -> float:
    """Counts ``examples`` processed since the last call; returns their rate per second."""
    now = time.perf_counter()
    elapsed = max(now - self._tick, 1e-9)
    self.examples += examples
    self.seconds += elapsed
    self._tick = now
    return examples / elapsed

  @contextlib.contextmanager
  def paused(self, state):
    """Time spent inside is not counted (the steps dispatched before it are: waits for them)."""
    jax.block_until_ready(state)
    start = time.perf_counter()
    try:
      yield
    finally:
      self._tick += time.perf_counter() - start

  @property
  def examples_per_s(self) -> float | None:
    return self.examples / self.seconds if self.seconds else None
