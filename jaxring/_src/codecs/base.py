"""What a codec is: how a partial sum is put on the wire and read back.

Wire dtype and accumulation dtype are separate: partial sums are accumulated in ``accum_dtype``
(f32 for 16-bit floats, the input dtype otherwise); only what crosses a link is narrow.
A payload is a tuple of flat arrays (e.g. int8 values and f32 block scales).
"""
from __future__ import annotations

from collections.abc import Callable

import ast
import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxring._src.codecs import kernels
from jaxring._src.ext.reference import take

# The largest block a blockwise codec takes: a block count of any buffer then fits every index
# type the kernels use, and a block (the ring's chunk alignment) stays a sane size.
MAX_BLOCK_SIZE = 2**31 - 1

_NARROW_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def accum_dtype(dtype) -> jnp.dtype:
  """Partial sums of 16-bit floats are carried in f32; every other dtype in itself."""
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.float32) if dtype in _NARROW_FLOATS else dtype


def is_float(dtype) -> bool:
  return jnp.issubdtype(jnp.dtype(dtype), jnp.floating)


@dataclasses.dataclass(frozen=True)
class Codec:
  """Base class: the identity on the wire (values travel in the input dtype).

  Subclasses override :meth:`encode`, :meth:`decode`, :meth:`wire_bytes` and, where one pass is
  faster, :meth:`hop` and :meth:`last_hop`. ``align`` is the element granularity chunks must
  respect (a block size).

  A codec with ``per_hop = False`` (``topk_chunks``) is not run hop by hop: it wraps the whole
  all-reduce instead, through ``all_reduce(flat, dtype, *, reduce_norms, reduce_dense,
  want_error)``, and names the per-hop codec of what it does send in ``inner``.
  """

  name = "none"
  lossy = False
  align = 1
  per_hop = True
  # sends only part of the values each step (the rest waits in error feedback): momentum and
  # Adam must then run before compression (jaxring.momentum_correction, compressed_adam)
  sparsifying = False

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    _CLASSES[cls.__qualname__] = cls   # for from_repr: a profile names codecs by their repr

  def applies_to(self, dtype) -> bool:
    """Whether this codec compresses ``dtype``; other dtypes travel uncompressed."""
    return True

  def wire_bytes(self, n: int, dtype=jnp.float32) -> int:
    """Bytes on the wire for ``n`` elements of ``dtype`` (the one place this arithmetic lives)."""
    return int(n) * jnp.dtype(dtype).itemsize

  def encode(self, x, dtype) -> tuple:
    """Puts the accumulator-dtype array ``x`` on the wire for values of ``dtype``."""
    return (x.astype(dtype),)

  def decode(self, payload: tuple, dtype):
    """Reads a payload back into the accumulator dtype of ``dtype``."""
    return payload[0].astype(accum_dtype(dtype))

  def hop(self, payload: tuple, local, dtype) -> tuple:
    """One ring hop: decode what arrived, add the local partial, encode for the next hop."""
    partial = self.decode(payload, dtype) + local
    return partial, self.encode(partial, dtype)

  def last_hop(self, payload: tuple, local, dtype):
    """The last hop of a reduce-scatter: decode what arrived and add the local partial."""
    return self.decode(payload, dtype) + local

  # The ring's local chunk is ``base[offset:offset + n]`` of its buffer (``offset`` an int, or a
  # traced int32 where it depends on the device's rank). A codec whose kernels read it where it
  # lies overrides these; sliced, XLA copies it before a custom call (ext/window.py).
  def encode_at(self, base, offset, n: int, dtype) -> tuple:
    """:meth:`encode` of the ring's local chunk ``base[offset:offset + n]``."""
    return self.encode(take(base, offset, n), dtype)

  def hop_at(self, payload: tuple, base, offset, n: int, dtype) -> tuple:
    """:meth:`hop` with the local partial ``base[offset:offset + n]``."""
    add = self._f32_add(payload, base, n)
    if add is not None:   # f32 travels as it is: the new partial is what goes on
      partial = add(payload[0], base, offset)
      return partial, (partial,)
    return self.hop(payload, take(base, offset, n), dtype)

  def last_hop_at(self, payload: tuple, base, offset, n: int, dtype):
    """:meth:`last_hop` with the local partial ``base[offset:offset + n]``."""
    add = self._f32_add(payload, base, n)
    if add is not None:
      return add(payload[0], base, offset)
    return self.last_hop(payload, take(base, offset, n), dtype)

  def _f32_add(self, payload: tuple, base, n: int):
    """``recv + base[offset:offset + n]`` read in place, for a codec that sends f32 as it is
    (this class's encode and decode); else None. One rounding, as the jnp add."""
    plain = type(self).encode is Codec.encode and type(self).decode is Codec.decode
    if not plain or len(payload) != 1 or payload[0].dtype != jnp.float32:
      return None
    return kernels.in_place("ring_hop_cast_last", base, n)

  def in_process_decode(self, dtype) -> int | None:
    """How the in-process transport may decode this codec's payload for ``dtype`` while it
    gathers it (``transport.inprocess.all_gather_decode``): ``0`` for one 16-bit float array
    widened to f32, a block size for int8 codes with f32 block scales, None when it cannot (the
    payload is then gathered, then decoded)."""
    narrow = jnp.dtype(dtype) in _NARROW_FLOATS
    return 0 if type(self) is Codec and narrow else None

  def compression_ratio(self, dtype=jnp.float32, n: int = 1 << 20) -> float:
    """Wire bytes relative to sending ``n`` values of ``dtype`` uncompressed."""
    return self.wire_bytes(n, dtype) / (n * np.dtype(dtype).itemsize)


def none() -> Codec:
  """No compression: values travel in their own dtype, partial sums accumulate in f32 or wider.

  Example:
    >>> jaxring.codecs.none().wire_bytes(1024, jnp.float32)
    4096
  """
  return Codec()


def for_dtype(codec: Codec | None, dtype) -> Codec:
  """The codec that applies to leaves of ``dtype`` (lossy codecs skip non-float leaves)."""
  if codec is None or not codec.applies_to(dtype):
    return Codec()
  return codec


# name -> (grammar, reader, in the sweep): each codec module registers how it is spelled
# (``spelling``), so a new codec is one file and parse() imports none of them; calibrate, the
# benchmarks and the simulator take their codec lists from here (sweep, spellings).
_SPELLINGS: dict[str, tuple[str, Callable[[list[str], Codec | None], Codec], bool]] = {}
# class name, as its repr spells it -> codec class (Codec.__init_subclass__), for from_repr
_CLASSES: dict[str, type] = {"Codec": Codec}


def spelling(grammar: str, *names: str, sweep: bool = False):
  """Registers a reader of ``name[:arg...]`` for ``parse``: ``reader(args, inner) -> Codec``.

  ``inner`` is the codec after a ``+`` (None without one); a reader that takes none raises.
  ``sweep``: the first name, with no arguments, is one of the codecs calibration, the
  benchmarks and the simulator try by default (:func:`sweep`); the other names are aliases.

  Example:
    >>> @spelling("int8[:block_size[:stochastic]]", "int8", sweep=True)  # doctest: +SKIP
    ... def _read(args, inner): ...
  """
  def register(reader):
    for i, name in enumerate(names):
      _SPELLINGS[name] = (grammar, reader, sweep and i == 0)
    return reader
  return register


def sweep(*, per_hop: bool = False) -> tuple[str, ...]:
  """The codec spellings tried by default (``none`` first, then those registered with
  ``sweep=True``, in registration order): calibration's candidates, the benchmarks' and the
  simulator's ``--codecs``. ``per_hop``: only the codecs run hop by hop (what ``all_gather``
  and ``psum_scatter`` take; not top-k, which wraps a whole all-reduce).

  Example:
    >>> sweep()
    ('none', 'bf16', 'int8', 'topk')
    >>> sweep(per_hop=True)
    ('none', 'bf16', 'int8')
  """
  names = ("none", *(name for name, (_, _, swept) in _SPELLINGS.items() if swept))
  return tuple(n for n in names if not per_hop or getattr(parse(n), "per_hop", True))


def spellings() -> tuple[str, ...]:
  """Every codec name ``parse`` reads (aliases included), ``none`` first.

  Example:
    >>> spellings()
    ('none', 'bf16', 'fp16', 'int8', 'fp4', 'topk', 'topk_chunks')
  """
  return ("none", *_SPELLINGS)


def name_of(codec: Codec | None) -> str:
  """The registered name of ``codec``'s kind: the first name of the spelling whose reader, with
  no arguments, builds a codec of its class (``none`` for None and the identity ``Codec()``).

  Example:
    >>> name_of(parse("int8:128"))
    'int8'
  """
  if codec is None or type(codec) is Codec:
    return "none"
  for name, (_, reader, _) in _SPELLINGS.items():
    try:
      default = reader([], None)
    except (ValueError, TypeError):
      continue
    if type(default) is type(codec):
      return name
  raise ValueError(f"no spelling of the codec {codec!r}; spellings: {grammar()}")


def from_repr(text: str) -> Codec:
  """The codec whose ``repr`` is ``text``, as a calibration profile names each level's codec
  (``planner.codec_key``): the class by its name, its dataclass fields as keywords (literals,
  or codecs themselves); the fields a repr leaves out take their defaults.

  Raises:
    ValueError: ``text`` is not the repr of a codec class defined in this process.

  Example:
    >>> from_repr("Int8(block_size=128, stochastic=False)")
    Int8(block_size=128, stochastic=False)
  """
  def build(node):
    if isinstance(node, ast.Call):
      cls = _CLASSES.get(node.func.id if isinstance(node.func, ast.Name) else "")
      if cls is None:
        raise ValueError(f"{ast.unparse(node.func)} is no codec class")
      if node.args:
        raise ValueError("a codec's repr names its fields")
      return cls(**{k.arg: build(k.value) for k in node.keywords})
    return ast.literal_eval(node)
  try:
    return build(ast.parse(str(text).strip(), mode="eval").body)
  except (SyntaxError, ValueError, TypeError) as e:
    raise ValueError(f"not a codec's repr: {text!r} ({e})") from e


def no_inner(name: str, inner) -> None:
  if inner is not None:
    raise ValueError(f"only topk takes a +<codec>, not {name}")


def grammar() -> str:
  """Every spelling ``parse`` reads, with its arguments, for messages and ``--help``.

  Example:
    >>> grammar()[:36]
    'none, bf16, fp16[:block_size], int8['
  """
  return ", ".join(["none", *dict.fromkeys(g for g, _, _ in _SPELLINGS.values())])


def parse(spec: str | Codec | None) -> Codec | None:
  """The codec a command line or a config names: ``"int8:256"`` -> ``int8(256)``.

  The one spelling of codecs as strings (benchmarks, the cluster worker, the recipes and the demo
  all read it here): ``none`` (None: no compression), ``bf16``, ``fp16[:block_size]``,
  ``int8[:block_size[:stochastic]]``, ``fp4[:block_size[:stochastic]]`` and
  ``topk[:density[:chunk_size[:per_tensor|global]]]``
  (``topk_chunks``, 1% by default, chunks chosen per tensor; the word ``global`` chooses the
  largest of the whole buffer), optionally
  ``+<codec>`` for the chosen chunks' per-hop codec. A ``Codec`` or None is returned as it is.
  Each codec module registers its own spelling (:func:`spelling`).

  Args:
    spec: the codec's name and arguments, colon-separated.

  Returns:
    The codec, or None for ``"none"``.

  Raises:
    ValueError: an unknown name or malformed arguments (the message lists the spellings).

  Example:
    >>> jaxring.codecs.parse("int8:128:stochastic")
    Int8(block_size=128, stochastic=True)
    >>> jaxring.codecs.parse("topk:0.05+int8").inner
    Int8(block_size=256, stochastic=False)
  """
  if spec is None or isinstance(spec, Codec):
    return spec
  name, _, inner = str(spec).strip().partition("+")
  name, *args = name.split(":")
  if name == "none" and not args and not inner:
    return None
  if name not in _SPELLINGS:
    raise ValueError(f"unknown codec {spec!r}; spellings: {grammar()}")
  try:
    return _SPELLINGS[name][1](args, parse(inner) if inner else None)
  except (ValueError, TypeError) as e:
    raise ValueError(f"bad codec {spec!r}: {e} (spellings: {grammar()})") from e
