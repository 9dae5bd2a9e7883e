"""Sharded train state (ZeRO-1/2 and FSDP/ZeRO-3): which leaves are split, and how.

With ``@jaxring.train_step(shard=...)`` a parameter leaf is split over the data-parallel replicas
along one dimension: the largest one the replica count divides (a leaf with none stays whole,
replicated; they are the small ones: biases of odd widths, a 10-class head). The global arrays
keep their shapes, so code outside the step sees an ordinary state whose arrays happen to be
sharded (``NamedSharding``): orbax saves and restores them sharded, on this device count or
another, and a ``jax.jit`` evaluation reads them as it reads any array. Inside the step each
replica sees its block.

``shard="optimizer"``: parameters stay replicated in the state, the optimizer state is split, the
step reduce-scatters gradients, updates the local block and all-gathers the parameters.
``shard="params"``: parameters and optimizer state are split; the step all-gathers each bucket of
parameters where the forward pass first uses it and again in the backward pass (rematerialized:
the gathered copy is not kept in between), and reduce-scatters the gradients bucket by bucket.

The optimizer then runs on blocks with a global view (jaxring._src.train.global_view): its
whole-leaf reductions (``optax.clip_by_global_norm``, LAMB's trust ratio, Adafactor's factored
moments) are finished by all-reduces across the replicas.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxring._src.collectives import axis_names

MODES = ("none", "optimizer", "params")
DIRECTIONS = ("params", "grads")


def validate_shard(shard) -> str:
  """``shard`` as one of :data:`MODES` (None means ``"none"``); ValueError otherwise."""
  shard = "none" if shard is None else shard
  if shard not in MODES:
    raise ValueError(f"train_step: shard must be one of {MODES}, got {shard!r}")
  return shard


def split_compression(compression, shard: str) -> tuple[Any, Any]:
  """``(params codec, grads codec)`` from the decorator's ``compression=``.

  A dict with the keys ``"params"`` and/or ``"grads"`` names each direction (each value is what
  :func:`jaxring.psum` takes: None, a codec, or a dict level -> codec); anything else is the
  gradients' compression, with the parameters moving exactly.

  Example:
    >>> split_compression({"params": int8(), "grads": {"node": int8()}}, "params")
    (Int8(...), {'node': Int8(...)})
  """
  if not (isinstance(compression, dict) and compression
          and set(compression) <= set(DIRECTIONS)):
    return None, compression
  if shard != "params" and compression.get("params") is not None:
    raise ValueError(f"train_step: compression['params'] compresses the parameters' all-gather of "
                     f"shard='params'; with shard={shard!r} the parameters do not travel "
                     "(ZeRO-1/2 gathers them exactly: replicas must agree)")
  return compression.get("params"), compression.get("grads")


def shard_dim(shape, p: int) -> int | None:
  """The dimension a leaf of ``shape`` is split along over ``p`` replicas: the largest one ``p``
  divides (the first of equals), or None (kept whole).

  Example:
    >>> shard_dim((3, 3, 64, 128), 8), shard_dim((10,), 8)
    (3, None)
  """
  best = None
  for d, n in enumerate(shape):
    if n % p == 0 and n >= p and (best is None or n > shape[best]):
      best = d
  return best if p > 1 else None


def leaf_spec(dim: int | None, ndim: int, axis_name) -> P:
  """The PartitionSpec of a leaf split along ``dim`` (None: replicated)."""
  if dim is None:
    return P()
  spec = [None] * ndim
  spec[dim] = axis_name
  return P(*spec)


def param_dims(params, p: int):
  """A tree like ``params`` of each leaf's split dimension (or None)."""
  return jax.tree_util.tree_map(lambda x: shard_dim(np.shape(x), p), params)


def dim_list(params, dims) -> list:
  """``dims`` (of :func:`param_dims`) as a list, one entry per leaf of ``params``: a parameter
  tree may hold None itself (a layer without a bias), which is no leaf and has no entry."""
  return jax.tree_util.tree_structure(params).flatten_up_to(dims)


def specs_like(params, dims, axis_name):
  leaves, treedef = jax.tree_util.tree_flatten(params)
  return jax.tree_util.tree_unflatten(treedef, [
      leaf_spec(d, np.ndim(x), axis_name) for x, d in zip(leaves, dim_list(params, dims))])


def opt_state_specs(opt_state, params, specs):
  """PartitionSpecs of an optimizer state: every subtree shaped like the parameters (momentum,
  Adam's moments) is split like them, the rest (step counts, schedules' state) replicated.

  A subtree is shaped like the parameters when it has their tree structure down to each
  parameter's position and holds there either an array of that parameter's shape or nothing at
  all (``optax.masked`` and ``optax.multi_transform`` put an empty ``MaskedNode`` where a
  parameter is not theirs).
  """
  pdef = jax.tree_util.tree_structure(params)
  shapes = [np.shape(x) for x in jax.tree_util.tree_leaves(params)]
  spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))

  def positions(x):
    """``x``'s subtrees at the parameters' positions, or None where ``x`` is not like them."""
    try:
      subs = pdef.flatten_up_to(x)
    except Exception:  # noqa: BLE001 (another structure, or a node jax cannot flatten)
      return None
    found = False
    for sub, shape in zip(subs, shapes):
      if not jax.tree_util.tree_leaves(sub):
        continue
      if not hasattr(sub, "shape") or np.shape(sub) != shape:
        return None
      found = True
    return subs if found else None

  def like_params(x) -> bool:
    return positions(x) is not None

  def spec_of(x):
    subs = positions(x)
    if subs is None:
      return jax.tree_util.tree_map(lambda _: P(), x)
    return jax.tree_util.tree_unflatten(pdef, [
        spec if jax.tree_util.tree_leaves(sub) else sub for sub, spec in zip(subs, spec_leaves)])

  return jax.tree_util.tree_map(spec_of, opt_state, is_leaf=like_params)


def state_specs(state, shard: str, p: int, axis_name):
  """PartitionSpecs of every leaf of ``state`` for ``shard``: params (``"params"``) and the
  optimizer state (``"optimizer"`` and ``"params"``) split, everything else replicated."""
  specs = jax.tree_util.tree_map(lambda _: P(), state)
  if shard == "none" or getattr(state, "params", None) is None:
    return specs
  dims = param_dims(state.params, p)
  pspecs = specs_like(state.params, dims, axis_name)
  changes = {}
  if shard == "params":
    changes["params"] = pspecs
  if getattr(state, "opt_state", None) is not None:
    changes["opt_state"] = opt_state_specs(state.opt_state, state.params, pspecs)
  return specs.replace(**changes)


def shardings(specs, mesh):
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                is_leaf=lambda s: isinstance(s, P))


def default_mesh(axis_name="data") -> Mesh:
  """All devices of all processes on one axis, or (processes, local devices) for two axes.

  Example:
    >>> dict(jaxring.train.default_mesh(("node", "local")).shape)  # one process, 8 devices
    {'node': 1, 'local': 8}
  """
  axes = axis_names(axis_name)
  devices = np.asarray(jax.devices())
  if len(axes) == 1:
    shape = (devices.size,)
  elif len(axes) == 2:
    shape = (jax.process_count(), jax.local_device_count())
  else:
    raise ValueError(f"default_mesh: pass a mesh for {len(axes)} axes {axes}")
  return Mesh(devices.reshape(shape), axes, axis_types=(AxisType.Auto,) * len(axes))


def place(x, sharding: NamedSharding):
  """``x`` on the mesh with ``sharding``: a copy the step may donate, made the same way on every
  process of a multi-process job."""
  if isinstance(x, (int, float, bool)) or getattr(x, "weak_type", False):
    # TrainState.create's step=0 is a Python int (weakly typed once on a device), a restored or
    # stepped one is not: the whole step would compile twice for that difference alone
    x = jnp.asarray(x, jnp.result_type(x))
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  if jax.process_count() > 1:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
  # a copy: the step donates the state, which must not delete the caller's arrays (e.g. the
  # variables returned by model.init, shared with other states); device_put(may_alias=False)
  # still aliases the caller's buffer as the first device's shard (jax 0.10)
  if isinstance(x, jax.Array):
    x = jnp.copy(x)
  return jax.device_put(x, sharding)


# --- a replica's block and the rows of a collective -----------------------------------------------


def to_rows(full, d: int, p: int):
  """``(p, n / p)``: row ``i`` is replica ``i``'s block of ``full`` (split along ``d``), flat."""
  shape = full.shape
  split = shape[:d] + (p, shape[d] // p) + shape[d + 1:]
  return jnp.moveaxis(full.reshape(split), d, 0).reshape(p, -1)


def from_rows(rows, d: int, shape):
  """The inverse of :func:`to_rows`: the full leaf of ``shape`` from its ``p`` rows."""
  p = rows.shape[0]
  block = shape[:d] + (shape[d] // p,) + shape[d + 1:]
  return jnp.moveaxis(rows.reshape((p,) + tuple(block)), 0, d).reshape(shape)


def full_shape(block_shape, d: int | None, p: int) -> tuple:
  """The shape of the leaf whose blocks (split along ``d`` over ``p`` replicas) are
  ``block_shape`` (``block_shape`` itself when ``d`` is None)."""
  block_shape = tuple(block_shape)
  if d is None:
    return block_shape
  return block_shape[:d] + (block_shape[d] * p,) + block_shape[d + 1:]


def local_block(full, d: int | None, p: int, index):
  """Replica ``index``'s block of ``full`` (``full`` itself when ``d`` is None)."""
  if d is None:
    return full
  n = full.shape[d] // p
  return jax.lax.dynamic_slice_in_dim(full, index * n, n, axis=d)


# --- memory -------------------------------------------------------------------------------------


def bytes_per_device(tree) -> int:
  """Bytes one device holds of ``tree``'s arrays (its addressable shard on the first device)."""
  total = 0
  for x in jax.tree_util.tree_leaves(tree):
    if isinstance(x, jax.Array):
      shard = x.addressable_shards[0]
      total += int(np.prod(shard.data.shape)) * x.dtype.itemsize
    elif hasattr(x, "dtype"):
      total += int(np.size(x)) * np.dtype(x.dtype).itemsize
  return total


def memory_report(state, residuals, compiled) -> dict:
  """Bytes per device: the state's parameters, optimizer state and residuals as they sit on the
  first device, and the compiled step's argument, output, temporary and peak bytes."""
  out = {"params": bytes_per_device(getattr(state, "params", None)),
         "opt_state": bytes_per_device(getattr(state, "opt_state", None)),
         "residuals": bytes_per_device(residuals)}
  stats = compiled.memory_analysis()
  if stats is not None:
    for key in ("argument", "output", "temp", "alias"):
      out[f"step_{key}"] = int(getattr(stats, f"{key}_size_in_bytes", 0) or 0)
    # what one device holds at most during the step: inputs, outputs not aliased to them, and
    # XLA's temporary buffers (XLA:CPU's own peak_memory_in_bytes leaves the temporaries out)
    out["step_peak"] = (out["step_argument"] + out["step_output"] - out["step_alias"]
                        + out["step_temp"])
  return out
