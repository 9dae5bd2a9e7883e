"""CRC32 of every array of a checkpointed state, shard by shard, checked again on restore.

Why: orbax stores arrays in OCDBT files whose chunks carry no checksum of their own; incompressible
data (trained float weights) is stored raw, so a flipped bit on disk is read back as a wrong value
without any error. A CRC32 over each array's host bytes (zlib, ~2 GB/s here) catches that.

Each array is recorded per distinct shard of its sharding at save (``"start:stop,..."`` regions of
its global shape), so no process needs bytes it does not hold: in a multi-process job the owner of
each shard computes its CRC and the small vector of CRCs is all-gathered, so that the record,
written by process 0, is complete. On restore each process checks the regions it holds; a region
recorded as one shard but restored split across the devices of several processes (a finer
sharding than at save) cannot be checked locally and is counted as unverified. Typed PRNG keys
are checked through their key data. Python scalars (a plain ``int`` step) are recorded by value.
"""
from __future__ import annotations

import json
import zlib
from typing import Any

import jax
import numpy as np

Region = tuple[tuple[int, int], ...]


def _is_key(x) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host(x) -> np.ndarray:
  """Host copy of a (single-device) array; typed PRNG keys as their key data."""
  if isinstance(x, jax.Array) and _is_key(x):
    x = jax.random.key_data(x)
  return np.asarray(x)


def crc32(a: np.ndarray) -> int:
  """CRC32 of an array's bytes in C order.

  Example:
    >>> crc32(np.zeros(4, np.uint8))
    2144628708
  """
  a = np.ascontiguousarray(a)
  return zlib.crc32(a.reshape(-1).view(np.uint8))


def crc32_json(value: Any) -> int:
  """CRC32 of a JSON value in canonical form (sorted keys, no spaces)."""
  return zlib.crc32(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


def _region(index: tuple, shape: tuple[int, ...]) -> Region:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _key(region: Region) -> str:
  return ",".join(f"{a}:{b}" for a, b in region)


def _parse(key: str) -> Region:
  return tuple(tuple(int(v) for v in part.split(":")) for part in key.split(",")) if key else ()


def _contains(outer: Region, inner: Region) -> bool:
  return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def _array_leaves(tree) -> list[tuple[str, Any]]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]


def _describe_leaf(leaf) -> dict | None:
  if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
    return {"shape": list(leaf.shape), "dtype": str(leaf.dtype)}
  if isinstance(leaf, (bool, int, float, np.generic)):
    return {"shape": None, "dtype": "scalar"}
  return None


def _scalar(leaf) -> str:
  return repr(np.asarray(leaf).item())


def record(tree) -> dict:
  """The checksums of every array (and scalar) leaf of ``tree``, identical on every process.

  A collective in a multi-process job (every process must call it): each shard's CRC comes from
  the process that holds it.

  Returns:
    ``{path: {"shape", "dtype", "crc32": {region: crc}} | {..., "value": repr}}``.
  """
  me = jax.process_index()
  out: dict[str, dict] = {}
  gathered: list[tuple[dict, str, int]] = []  # (entry, region, owner process)
  values: list[int] = []
  for path, leaf in _array_leaves(tree):
    entry = _describe_leaf(leaf)
    if entry is None:
      continue
    out[path] = entry
    if entry["dtype"] == "scalar":
      entry["value"] = _scalar(leaf)
      continue
    entry["crc32"] = {}
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
      _record_local(entry, leaf)
      continue
    owners: dict[str, jax.Device] = {}
    for dev, index in sorted(leaf.sharding.devices_indices_map(leaf.shape).items(),
                             key=lambda kv: kv[0].id):
      owners.setdefault(_key(_region(index, leaf.shape)), dev)
    local = {s.device: s for s in leaf.addressable_shards}
    for region, dev in owners.items():
      gathered.append((entry, region, dev.process_index))
      values.append(crc32(_host(local[dev].data)) if dev.process_index == me else 0)
  if gathered:
    from jax.experimental import multihost_utils
    table = np.asarray(multihost_utils.process_allgather(np.asarray(values, np.uint32)))
    for j, (entry, region, owner) in enumerate(gathered):
      entry["crc32"][region] = int(table[owner, j])
  return out


def _record_local(entry: dict, leaf) -> None:
  if not isinstance(leaf, jax.Array):
    entry["crc32"][_key(_region((slice(None),) * np.ndim(leaf), np.shape(leaf)))] = crc32(
        np.asarray(leaf))
    return
  for shard in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
    region = _key(_region(shard.index, leaf.shape))
    if region not in entry["crc32"]:
      entry["crc32"][region] = crc32(_host(shard.data))


def describe(tree) -> dict:
  """``{path: {"shape", "dtype"}}`` of ``tree``'s array and scalar leaves (a record's keys)."""
  return {p: d for p, leaf in _array_leaves(tree) if (d := _describe_leaf(leaf)) is not None}


def mismatch(template, saved: dict) -> str | None:
  """How ``template``'s leaves differ from a record's (paths, shapes, dtypes); None if alike."""
  want = describe(template)
  have = {p: {"shape": e["shape"], "dtype": e["dtype"]} for p, e in saved.items()}
  problems = [f"{p} is not in the checkpoint" for p in want if p not in have]
  problems += [f"the checkpoint has {p}, the template does not" for p in have if p not in want]
  problems += [f"{p}: checkpoint {have[p]['dtype']}{have[p]['shape']}, template "
               f"{want[p]['dtype']}{want[p]['shape']}"
               for p in want if p in have and have[p] != want[p]]
  if not problems:
    return None
  more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
  return "; ".join(problems[:5]) + more


def verify(tree, saved: dict) -> tuple[list[str], int]:
  """Checks the restored ``tree`` against ``saved``, in the regions this process holds.

  Returns:
    ``(problems, unverified)``: one line per corrupt array region, and the number of recorded
    regions no device of this process holds whole.
  """
  problems, unverified = [], 0
  for path, leaf in _array_leaves(tree):
    entry = saved.get(path)
    if entry is None:
      continue
    if "value" in entry:
      if _scalar(leaf) != entry["value"]:
        problems.append(f"{path} is {_scalar(leaf)}, the checkpoint recorded {entry['value']}")
      continue
    whole = _region((slice(None),) * np.ndim(leaf), np.shape(leaf))
    if isinstance(leaf, jax.Array):
      held = [(_region(s.index, leaf.shape), s.data) for s in leaf.addressable_shards]
      if leaf.is_fully_addressable:  # a region split across local devices: check the whole
        held.append((whole, leaf))
    else:
      held = [(whole, leaf)]
    copies: dict[int, np.ndarray] = {}
    for key, want in entry["crc32"].items():
      region = _parse(key)
      holder = next(((r, i) for i, (r, _) in enumerate(held) if _contains(r, region)), None)
      if holder is None:
        unverified += _held_by_nobody(leaf, region)
        continue
      outer, i = holder
      if i not in copies:
        copies[i] = _host(held[i][1])
      part = copies[i][tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(outer, region))]
      if (got := crc32(part)) != want:
        problems.append(f"{path} [{key}]: crc32 {got:08x}, the checkpoint recorded {want:08x}")
  return problems, unverified


def _held_by_nobody(leaf, region: Region) -> int:
  """1 if no device anywhere holds ``region`` whole (nobody can check it), else 0."""
  if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
    return 1
  regions = {_region(i, leaf.shape) for i in leaf.sharding.devices_indices_map(leaf.shape).values()}
  return int(not any(_contains(r, region) for r in regions))
