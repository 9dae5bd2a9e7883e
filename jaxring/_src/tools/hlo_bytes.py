"""Bytes on the wire, read from compiled HLO: what the collectives of a program really move.

XLA rewrites collectives on the way to the machine (XLA:CPU promotes bf16 all-reduces and
ppermutes to f32, for one), so wire sizes are read from ``jax.jit(f).lower(...).compile()
.as_text()``, never from the source. Each collective instruction's operands are looked up by name
in the module (the compiled text does not print operand shapes inline), and its bytes sent per
member are counted as a bandwidth-optimal implementation sends them (Thakur et al. 2005), for a
group of ``g`` members and an operand of ``b`` bytes on each:

  collective-permute   b * (pairs with source != target) / devices   (each sender sends b once)
  all-gather           b * (g - 1)
  reduce-scatter       b * (g - 1) / g
  all-reduce           b * 2 (g - 1) / g
  all-to-all           b * (g - 1) / g

``operand_bytes`` is the plain sum of the collectives' operand sizes, without that weighting.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

_OPS = ("collective-permute", "all-gather", "reduce-scatter", "all-reduce", "all-to-all")
_ITEMSIZE = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
             "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
# "%name = <shape> <opcode>(<operands>), <attributes>"
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled module."""

  name: str
  op: str                 # "all-gather", "collective-permute", ...
  dtypes: tuple[str, ...]  # element types of its operands
  operand_bytes: int      # bytes of its operands, on one member
  group_size: int
  sent_bytes: float       # bytes one member sends, averaged over members (see module docstring)


@dataclasses.dataclass(frozen=True)
class WireBytes:
  """The collectives of one compiled program and their bytes."""

  collectives: tuple[Collective, ...]
  num_devices: int

  @property
  def sent_bytes(self) -> float:
    """Bytes one member sends in the whole program (the wire traffic per member link)."""
    return float(sum(c.sent_bytes for c in self.collectives))

  @property
  def operand_bytes(self) -> int:
    """Plain sum of the collectives' operand sizes on one member."""
    return sum(c.operand_bytes for c in self.collectives)

  def by_op(self) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in self.collectives:
      out[c.op] = out.get(c.op, 0.0) + c.sent_bytes
    return out


def _shape_bytes(shape_text: str) -> tuple[int, list[str]]:
  """Total bytes and element types of an HLO shape (an array or a tuple of them)."""
  total, dtypes = 0, []
  for dt, dims in _ARRAY.findall(shape_text):
    if dt not in _ITEMSIZE:
      continue
    n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    total += n * _ITEMSIZE[dt]
    dtypes.append(dt)
  return total, dtypes


def _operand_names(args: str) -> list[str]:
  """Names of the operands in the text following ``opcode(`` (up to the matching paren)."""
  depth, end = 1, len(args)
  for i, ch in enumerate(args):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      end = i
      break
  return re.findall(r"%([\w.\-]+)", args[:end])


def _group_size(attrs: str, num_devices: int) -> int:
  m = re.search(r"replica_groups=\{(\{[0-9,]*\})", attrs)
  if m:
    return max(1, len([t for t in m.group(1).strip("{}").split(",") if t]))
  m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)  # iota form: [groups, size]<=[n]
  if m:
    return int(m.group(1).split(",")[-1])
  return num_devices


def _num_devices(text: str) -> int:
  m = re.search(r"num_partitions=(\d+)", text)
  parts = int(m.group(1)) if m else 1
  m = re.search(r"replica_count=(\d+)", text)
  return max(parts, int(m.group(1)) if m else 1)


def _sent(op: str, b: int, g: int, attrs: str, num_devices: int) -> float:
  if op == "collective-permute":
    pairs = re.findall(r"\{(\d+),(\d+)\}", attrs.split("source_target_pairs=", 1)[-1]
                       .split("}}", 1)[0] + "}")
    moving = sum(1 for s, t in pairs if s != t)
    return b * moving / max(num_devices, 1)
  if g <= 1:
    return 0.0
  if op == "all-gather":
    return float(b * (g - 1))
  if op == "all-reduce":
    return b * 2 * (g - 1) / g
  return b * (g - 1) / g  # reduce-scatter, all-to-all


def wire_bytes(hlo_text: str) -> WireBytes:
  """The collectives of a compiled HLO module and the bytes each member sends.

  Args:
    hlo_text: ``jax.jit(f).lower(*args).compile().as_text()`` (optimized HLO).

  Returns:
    A :class:`WireBytes`; ``.sent_bytes`` is the per-member wire traffic.

  Example:
    >>> text = jax.jit(f).lower(x).compile().as_text()
    >>> wire_bytes(text).sent_bytes / 2**20  # MiB one member sends
    56.0
  """
  num_devices = _num_devices(hlo_text)
  shapes: dict[str, str] = {}
  instrs = []
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    name, shape, opcode, rest = m.groups()
    shapes[name] = shape
    base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
    if base in _OPS:
      instrs.append((name, base, shape, rest))
  out = []
  for name, op, shape, rest in instrs:
    names = _operand_names(rest)
    b, dtypes = 0, []
    for operand in names:
      ob, odt = _shape_bytes(shapes.get(operand, ""))
      b += ob
      dtypes += odt
    if not names or not dtypes:  # operand not found: fall back on the result's shape
      b, dtypes = _shape_bytes(shape)
    g = _group_size(rest, num_devices)
    out.append(Collective(name, op, tuple(dtypes), b, g, _sent(op, b, g, rest, num_devices)))
  return WireBytes(tuple(out), num_devices)


def compiled_wire_bytes(fn, *args) -> WireBytes:
  """:func:`wire_bytes` of ``jax.jit(fn)`` compiled for ``args`` (arrays or ShapeDtypeStructs)."""
  import jax
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  return wire_bytes(jitted.lower(*args).compile().as_text())
