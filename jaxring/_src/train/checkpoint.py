"""Checkpoints of a train state and the data position, with orbax's ``CheckpointManager``.

What makes a resumed run bit-identical to an uninterrupted one is saving *everything* the next step
reads: parameters, optimizer state, step, RNG key, BatchNorm statistics, the loss scale, each
replica's error-feedback residuals (sharded arrays: every replica's own) and the data iterator's
position (JSON). Restoring into a template state puts each array back with the template's sharding.
A save taken while a host-side transfer is in flight (``jaxring.diloco(transfer="host")``
between a fragment's send and its arrival) waits for it and keeps its result; the restore gives
it back to the resumed step (jaxring._src.transport.host_exchange).

A save is atomic: orbax writes into ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>``
only after every file is written (the rename is atomic on POSIX file systems), so a crash in the
middle of a save leaves a temporary directory that is never read (and is removed on the next
start), and the last committed checkpoint is intact. ``max_to_keep`` deletes older steps only after
a newer one has been committed.

A restore is verified: every save also records a CRC32 of each array (shard by shard, see
:mod:`jaxring._src.train.checksums`) and of the data position, in a third item committed with the
others. A checkpoint whose bytes no longer match, or that orbax cannot read although the template
matches what was saved (a deleted or damaged file), raises :class:`CheckpointCorruptError` naming
the step, its path and what is wrong; :func:`jaxring.train.fit` then falls back to the previous
committed step. Checkpoints written before checksums were recorded restore unverified, with a
warning.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np

from jaxring._src.train import checksums, nnx_step
from jaxring._src.train.state import residual_tree, with_residual_tree
from jaxring._src.transport import host_exchange

log = logging.getLogger(__name__)

_CHECKSUMS = "checksums"           # the orbax item holding the record
_MARK = "jaxring_checksums"        # in the step's custom metadata: a record was written
_RESIDUALS = "residuals"           # per replica, so not among the state's leaves (train/state.py)
_TRANSFERS = "transfers"           # host-side transfers in flight: their results
# Files orbax's StandardCheckpointHandler cannot restore without (it names none of them when one
# is gone: a missing _METADATA surfaces as a pytree-structure mismatch).
_REQUIRED_STATE_FILES = ("_METADATA",)


class CheckpointCorruptError(OSError):
  """A committed checkpoint cannot be restored as it was saved.

  Raised when an array's bytes differ from the CRC32 recorded at save, or when orbax fails to read
  a checkpoint whose recorded structure matches the template (a file deleted, truncated or
  damaged). An ``OSError`` like :class:`gzip.BadGzipFile`: the data on disk is bad.

  Attributes:
    step: the checkpoint's step.
    path: its directory.
    reason: what is wrong, in one or a few lines.
  """

  def __init__(self, step: int, path: str, reason: str):
    super().__init__(f"checkpoint step {step} at {path} is corrupt: {reason}")
    self.step, self.path, self.reason = step, path, reason


def _ocp():
  import orbax.checkpoint as ocp  # ~0.4 s: only when checkpoints are used, not on `import jaxring`
  return ocp


def _abstract(x):
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return x


def _with_saved_loss_scale(template, record: dict):
  """A fresh template's ``loss_scale`` is None until the step prepares it: give it one where
  the checkpoint holds one (fp16 training)."""
  if (getattr(template, "loss_scale", 0) is None
      and any(p.startswith(".loss_scale.") for p in record["arrays"])):
    from jaxring._src.train.precision import DynamicLossScale
    return template.replace(loss_scale=DynamicLossScale.create())
  return template


def _scalars_as_saved(template, saved: dict):
  """``template`` with each scalar leaf in the form it was saved in: a fresh
  ``TrainState.create(...)`` holds ``step=0`` as a Python int, a trained state an int32 array,
  and either may be the template for the other's checkpoint."""
  def convert(path, leaf):
    entry = saved.get(jax.tree_util.keystr(path))
    if entry is None:
      return leaf
    python = isinstance(leaf, (bool, int, float, np.generic))
    if python and entry["dtype"] != "scalar" and entry["shape"] == []:
      return jax.numpy.asarray(leaf, entry["dtype"])
    if (not python and entry["dtype"] == "scalar" and isinstance(leaf, jax.Array)
        and leaf.shape == ()):
      return leaf.item()
    return leaf
  return jax.tree_util.tree_map_with_path(convert, template)


def _host_residuals(params, saved: dict):
  """Empty host arrays shaped like the residuals recorded for ``params`` (None where none were
  saved, or they do not match the parameters' tree)."""
  if params is None or not saved:
    return None
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  entries = [saved.get(jax.tree_util.keystr(path)) for path, _ in leaves]
  if len(entries) != len(saved) or any(e is None or e["dtype"] == "scalar" for e in entries):
    return None
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), [
      np.empty(e["shape"], jax.numpy.dtype(e["dtype"])) for e in entries])


def _replicated_like(a, shape) -> jax.ShapeDtypeStruct:
  from jax.sharding import NamedSharding, PartitionSpec
  return jax.ShapeDtypeStruct(shape, a.dtype, sharding=NamedSharding(a.sharding.mesh,
                                                                     PartitionSpec()))


def _remap_residual(saved, template):
  """Residuals saved by ``p_old`` replicas for ``p_new``: each new replica carries the mean of
  the old ones, so the error all replicas add back to the next mean, ``sum(r) / p``, is the
  same (``p_new * mean / p_new == sum(r_old) / p_old``)."""
  mean = jax.numpy.mean(saved, axis=0, keepdims=True)
  return jax.device_put(jax.numpy.broadcast_to(mean, template.shape).astype(template.dtype),
                        template.sharding)


def _abstract_transfers(saved: dict) -> list:
  """Host arrays shaped as the saved transfers' results (the record's ``[i]`` paths)."""
  entries = sorted(saved["arrays"].items(), key=lambda kv: int(kv[0].strip("[]")))
  return [np.empty(e["shape"], e["dtype"]) for _, e in entries]


def _restore_transfers(saved: dict, arrays: list) -> None:
  """Gives the saved transfers' results back to the host exchanges, for the resumed step."""
  at = 0
  for name, owner, part, n in saved["index"]:
    host_exchange.restore(name, host_exchange.Key(owner, part), arrays[at:at + n])
    at += n


def _root_cause(exc: BaseException) -> str:
  """The first line of the innermost exception: tensorstore's own words, not orbax's wrapping."""
  seen = set()
  while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
    seen.add(id(exc))
    exc = inner
  text = str(exc).strip()
  return f"{type(exc).__name__}: {text.splitlines()[0][:400] if text else ''}"


def _checked_record(step: int, path: str, record) -> dict:
  if not isinstance(record, dict) or not isinstance(record.get("arrays"), dict):
    raise CheckpointCorruptError(step, path, f"its checksums ({_CHECKSUMS}/) are not a checksum "
                                 f"record: {str(record)[:200]}")
  return record


def _processes_with_problems(count: int) -> list[int]:
  """The processes that found problems (all processes learn the same list)."""
  if jax.process_count() == 1:
    return [0] if count else []
  from jax.experimental import multihost_utils
  counts = np.asarray(multihost_utils.process_allgather(np.asarray([count], np.int32)))
  return [int(p) for p in np.flatnonzero(counts.reshape(-1))]


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
    >>> state, data_state = ckpt.restore(fresh_state)  # the latest step, residuals too
    >>> state, data_state = ckpt.restore(step.prepare(fresh_state))  # restored on the devices

  A fresh ``TrainState.create(...)`` is a template for a trained state (its ``step=0`` is a
  Python int where the trained one holds an array; the residuals are read to the host and placed
  by the step's first call). Resuming on another device count needs the prepared template,
  whose residuals tell how many replicas to remap them to.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
               save_every: int = 1, async_save: bool = True):
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_every, create=True,
        cleanup_tmp_directories=True, enable_async_checkpointing=async_save)
    self.directory = os.fspath(os.path.abspath(directory))
    # Handlers named up front: reading a step's metadata then needs no guessing (and no warning
    # per item).
    handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                _CHECKSUMS: ocp.JsonCheckpointHandler(),
                _RESIDUALS: ocp.StandardCheckpointHandler(),
                _TRANSFERS: ocp.StandardCheckpointHandler()}
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def save(self, state, *, data_state: dict | None = None, step: int | None = None,
           force: bool = False) -> bool:
    """Saves ``state`` (and the data position) as ``step`` (default ``state.step``).

    The CRC32s of the arrays are computed here, before the write starts (a collective in a
    multi-process job: every process calls ``save``, as orbax requires anyway).

    Returns:
      Whether a save was started (``save_every`` may skip it).
    """
    if (objs := nnx_step.objects(state)) is not None:   # NNX: (model, optimizer)
      state = nnx_step.snapshot(objs)[0]
    if step is None:
      step = int(jax.device_get(state.step))
    if not force and not self._manager.should_save(step):
      return False
    ocp = _ocp()
    data = dict(data_state or {})
    residuals = residual_tree(state)
    record = {"arrays": checksums.record(state), "data": checksums.crc32_json(data)}
    items = {"state": ocp.args.StandardSave(state), "data": ocp.args.JsonSave(data)}
    if residuals is not None:
      items[_RESIDUALS] = ocp.args.StandardSave(residuals)
      record[_RESIDUALS] = checksums.record(residuals)
    if flight := host_exchange.in_flight():   # after record(): the step's sends have started
      arrays = [a for v in flight.values() for a in v]
      items[_TRANSFERS] = ocp.args.StandardSave(arrays)
      record[_TRANSFERS] = {"arrays": checksums.record(arrays), "index": [
          [name, key.owner, key.part, len(v)] for (name, key), v in flight.items()]}
    items[_CHECKSUMS] = ocp.args.JsonSave(record)
    args = ocp.args.Composite(**items)
    return self._manager.save(step, args=args, force=True, custom_metadata={_MARK: 1})

  @property
  def latest_step(self) -> int | None:
    """The newest committed step (a save still in progress or interrupted does not count)."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def step_path(self, step: int) -> str:
    """The directory of a committed ``step``."""
    return os.path.join(self.directory, str(step))

  def restore(self, template, *, step: int | None = None) -> tuple[Any, dict]:
    """Reads ``step`` (default: the latest) into arrays shaped and sharded like ``template``.

    Returns:
      ``(state, data_state)``; ``data_state`` is ``{}`` when none was saved.

    Raises:
      FileNotFoundError: no committed checkpoint.
      CheckpointCorruptError: the checkpoint's bytes differ from those saved, or a file of it is
        missing or unreadable.
      ValueError: ``template`` does not have the leaves (paths, shapes, dtypes) that were saved.
    """
    if (objs := nnx_step.objects(template)) is not None:   # NNX: restored in place
      snap, binding = nnx_step.snapshot(objs)
      state, data = self.restore(snap, step=step)
      return nnx_step.restore_into(objs, binding, state), data
    if step is None:
      step = self.latest_step
    if step is None:
      raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
    recorded = self._has_record(step)
    record = self._read_record(step) if recorded else None
    if recorded:   # a fresh TrainState.create(...) is a template for a trained state
      template = _scalars_as_saved(_with_saved_loss_scale(template, record), record["arrays"])
    abstract = jax.tree_util.tree_map(_abstract, template)
    ocp = _ocp()
    items = dict(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore())
    if recorded:
      items[_CHECKSUMS] = ocp.args.JsonRestore()
    residuals = residual_tree(template)
    if residuals is None and recorded and hasattr(template, "residuals"):
      # a template the step has not prepared (a fresh TrainState.create): read them to the host,
      # as saved; the step places them on its first call
      residuals = _host_residuals(getattr(template, "params", None), record.get(_RESIDUALS, {}))
    abstract_residuals = remap_to = None
    if residuals is not None and os.path.isdir(os.path.join(self.step_path(step), _RESIDUALS)):
      abstract_residuals = jax.tree_util.tree_map(_abstract, residuals)
      saved = self._saved_replicas(step, abstract_residuals) if recorded else None
      if saved is not None:  # saved by another replica count: read whole, then remap
        remap_to, abstract_residuals = residuals, jax.tree_util.tree_map(
            lambda a: _replicated_like(a, (saved,) + tuple(a.shape[1:])), abstract_residuals)
      items[_RESIDUALS] = ocp.args.StandardRestore(abstract_residuals)
    if recorded and _TRANSFERS in record:
      items[_TRANSFERS] = ocp.args.StandardRestore(_abstract_transfers(record[_TRANSFERS]))
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as exc:  # noqa: BLE001 - orbax/tensorstore raise many kinds
      if not recorded:
        raise  # nothing recorded: a damaged file and a template mismatch look alike
      self._raise_mismatch(step, abstract, abstract_residuals, record)
      raise CheckpointCorruptError(step, self.step_path(step), self._explain(step, exc)) from exc
    state, data = restored["state"], dict(restored["data"] or {})
    if recorded:
      record = _checked_record(step, self.step_path(step), restored[_CHECKSUMS])
      self._raise_mismatch(step, abstract, abstract_residuals, record)
      self._verify(step, state, restored[_RESIDUALS] if _RESIDUALS in items else None,
                   data, record, restored[_TRANSFERS] if _TRANSFERS in items else None)
    if _TRANSFERS in items:
      _restore_transfers(record[_TRANSFERS], restored[_TRANSFERS])
    if _RESIDUALS in items:
      res = restored[_RESIDUALS]
      if remap_to is not None:
        res = jax.tree_util.tree_map(_remap_residual, res, remap_to)
      state = with_residual_tree(state, res)
    return state, data

  def _saved_replicas(self, step: int, abstract_residuals) -> int | None:
    """The replica count the residuals were saved with, where it is not the template's (and
    nothing else differs); None otherwise."""
    record = self._read_record(step).get(_RESIDUALS, {})
    want = {p: list(e["shape"]) for p, e in checksums.describe(abstract_residuals).items()}
    have = {p: e["shape"] for p, e in record.items()}
    if set(want) != set(have) or not want:
      return None
    counts = {h[0] for p, h in have.items() if h and want[p] and h[1:] == want[p][1:]}
    if len(counts) != 1 or any(not h or h[1:] != want[p][1:] for p, h in have.items()):
      return None
    (count,) = counts
    return None if count == next(iter(want.values()))[0] else count

  def _has_record(self, step: int) -> bool:
    """Whether ``step`` was saved with checksums (False: by a jaxring before they existed)."""
    path = self.step_path(step)
    try:
      marked = bool((self._manager.metadata(step).custom_metadata or {}).get(_MARK))
    except Exception as exc:  # noqa: BLE001
      raise CheckpointCorruptError(step, path, f"orbax could not read its metadata: "
                                   f"{_root_cause(exc)}") from exc
    if not marked and not os.path.isdir(os.path.join(path, _CHECKSUMS)):
      log.warning("checkpoint step %d at %s has no checksums (written by an older jaxring): "
                  "restored unverified", step, path)
      return False
    return True

  def _read_record(self, step: int) -> dict:
    ocp = _ocp()
    try:
      record = self._manager.restore(step, args=ocp.args.Composite(
          **{_CHECKSUMS: ocp.args.JsonRestore()}))[_CHECKSUMS]
    except Exception as exc:  # noqa: BLE001
      raise CheckpointCorruptError(step, self.step_path(step), f"its checksums ({_CHECKSUMS}/) "
                                   f"are missing or unreadable: {_root_cause(exc)}") from exc
    return _checked_record(step, self.step_path(step), record)

  def _raise_mismatch(self, step: int, abstract, abstract_residuals, record: dict) -> None:
    diff = checksums.mismatch(abstract, record["arrays"])
    if not diff and abstract_residuals is not None and _RESIDUALS in record:
      diff = checksums.mismatch(abstract_residuals, record[_RESIDUALS])
    if diff:
      raise ValueError(f"checkpoint step {step} at {self.step_path(step)} holds a different state "
                       f"than the template: {diff}")

  def _explain(self, step: int, exc: BaseException) -> str:
    path = self.step_path(step)
    missing = [f"state/{name}" for name in _REQUIRED_STATE_FILES
               if not os.path.exists(os.path.join(path, "state", name))]
    if missing:
      return f"{', '.join(missing)} is missing"
    return f"orbax could not read it: {_root_cause(exc)}"

  def _verify(self, step: int, state, residuals, data: dict, record: dict,
              transfers=None) -> None:
    problems, unverified = checksums.verify(state, record["arrays"])
    if residuals is not None and _RESIDUALS in record:
      more, more_unverified = checksums.verify(residuals, record[_RESIDUALS])
      problems += [f"residuals{p}" for p in more]
      unverified += more_unverified
    if _TRANSFERS in record:
      problems += [f"transfers{p}" for p in checksums.verify(
          transfers, record[_TRANSFERS]["arrays"])[0]]
    if checksums.crc32_json(data) != record.get("data"):
      problems.append("the data position differs from the one saved")
    if unverified:
      log.warning("checkpoint step %d: %d array regions were restored split across processes "
                  "and could not be checked", step, unverified)
    bad = _processes_with_problems(len(problems))
    if problems or bad:
      reason = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)"
                                          if len(problems) > 5 else "")
      if not problems:
        reason = f"process(es) {bad} found arrays whose bytes differ from the saved checksums"
      raise CheckpointCorruptError(step, self.step_path(step), reason)

  def set_aside(self, step: int) -> str:
    """Renames a corrupt ``step`` to ``<step>.corrupt`` (kept for inspection, no longer a step).

    Returns:
      The new path.
    """
    src, dst = self.step_path(step), self.step_path(step) + ".corrupt"
    n = 1
    while os.path.exists(dst):
      n += 1
      dst = f"{self.step_path(step)}.corrupt{n}"
    if jax.process_index() == 0:
      os.rename(src, dst)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"jaxring-checkpoint-set-aside-{step}")
    self._manager.reload()
    return dst

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
