""":func:`jaxring.diloco` with ``transfer="host"``: a fragment's pseudo-gradient moved over the
MPI-bound slow axis by the host thread (jaxring._src.transport.host_exchange) while the next
``delay`` inner steps run; the step programs only hand the bytes over and take them back.

Uncompressed, the members' shares are summed (``Iallreduce``). With a codec and ``delay >= 2``
the bytes are those of a ring with requantizing hops, in two stages: at the send each member
cuts its share into one chunk per member of the slow axis (``N``), encodes each and an
``Ialltoall`` hands chunk ``j`` to member ``j``; ``delay // 2`` steps later every member decodes
the ``N`` codes of its chunk, averages them, encodes the mean once and an ``Iallgather`` gives it
to all; at the arrival the ``N`` chunks are decoded. A member sends ``2 (N - 1) / N`` of its
share, as on the ring, and a value is encoded twice (the ring: ``N`` times). With ``delay=1``
no step lies between: each member's encoded share is gathered (``N - 1`` shares each).

In JAX's shape (one process per member of the slow axis, its devices the fast axes of a
``shard_map``, the process launched by ``mpirun`` and the slow axis also bound to MPI), each
device moves its own share on an exchange of its own (``host_exchange.exchange_for``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxring._src.transport import binding as binding_mod
from jaxring._src.transport import host_exchange, mpi_axis

F32 = jnp.float32


class HostSync:
  """The host-side sync of one :func:`jaxring.diloco` (``instance`` names its transfers).

  Args:
    axes: the slow axis names (bound to MPI).
    compression: the codec, or None.
    delay: the inner steps between a fragment's send and its arrival.
    instance: this transform's number in the process.
    shares: the fast axes' shares (``diloco_share.Shares``, called at trace time).
  """

  def __init__(self, axes, compression, delay: int, instance: int, shares):
    self.axes, self.compression, self.instance, self.shares = axes, compression, instance, shares
    self.staged = compression is not None and delay >= 2
    self.midway = delay // 2   # the stage-2 step, counted from the send

  def exchange(self):
    """(the exchange, or one per device of this process, and where this device is: None, or
    traced for ``host_exchange.start_in_program``)."""
    binding = mpi_axis.lookup(self.axes)
    if binding is None:
      raise ValueError(f"diloco(transfer='host'): the slow axis {self.axes} is not bound to MPI; "
                       "bind it with jaxring.distributed.bind_mpi_axis, and launch the processes "
                       "with mpirun (one per member of the slow axis)")
    index, members = self.shares().member()
    if isinstance(index, int):   # the fast axes bound to MPI too: a process per member
      return host_exchange.exchange_for(binding), None
    slow = binding_mod.bind(self.axes, "diloco")   # the mesh's axis where a shard_map binds it
    slow = slow if slow.lax_bound else None
    if slow is not None and slow.size != binding.size:
      raise ValueError(f"diloco(transfer='host'): the slow axis {self.axes} has {slow.size} "
                       f"members in the mesh but {binding.size} MPI ranks: launch one process "
                       "per member of the slow axis")
    node = lax.axis_index(self.axes) if slow is not None else jnp.int32(-1)
    return (host_exchange.exchange_for(binding, members),
            jnp.stack([jnp.asarray(index, jnp.int32), jnp.asarray(node, jnp.int32)]))

  def key(self, p: int, stage: str = "") -> host_exchange.Key:
    return host_exchange.Key(f"diloco {self.instance}", f"fragment {p}{stage}")

  def _chunks(self, m: int) -> tuple[int, int]:
    """(members of the slow axis, a chunk's length) for an ``m``-value share."""
    n = mpi_axis.lookup(self.axes).size
    align = max(int(getattr(self.compression, "align", 1) or 1), 1)
    return n, -(-m // (n * align)) * align

  def _encode_rows(self, rows) -> list:
    """Each row of ``rows`` encoded, the payloads' arrays stacked: one row per member."""
    payloads = [self.compression.encode(r, F32) for r in rows]
    return [jnp.stack(parts) for parts in zip(*payloads)]

  def _decode_rows(self, arrays):
    return jax.vmap(lambda *pl: self.compression.decode(pl, F32))(*arrays)

  def send(self, p: int, mine):
    """Starts fragment ``p``'s transfer of ``mine`` (this member's share, f32); returns what the
    codec made of it, as the others will decode it (``mine`` itself uncompressed)."""
    ex, where = self.exchange()
    if self.compression is None:
      host_exchange.start_in_program(ex, self.key(p), "sum", [mine], where)
      return mine
    if not self.staged:
      payload = self.compression.encode(mine, F32)
      host_exchange.start_in_program(ex, self.key(p), "gather", list(payload), where)
      return self.compression.decode(payload, F32)
    m = mine.shape[0]
    n, c = self._chunks(m)
    stacked = self._encode_rows(jnp.pad(mine, (0, n * c - m)).reshape(n, c))
    host_exchange.start_in_program(ex, self.key(p, " scatter"), "alltoall", stacked, where)
    return self._decode_rows(stacked).reshape(-1)[:m]

  def reduce(self, p: int, m: int) -> None:
    """Stage 2 of fragment ``p`` (an ``m``-value share): this member's chunk averaged and
    re-encoded, and its gather started."""
    ex, where = self.exchange()
    n, c = self._chunks(m)
    like = jax.eval_shape(lambda x: self._encode_rows(x), jax.ShapeDtypeStruct((n, c), F32))
    rows = host_exchange.finish_in_program(ex, self.key(p, " scatter"), "alltoall", like, where)
    mean = self._decode_rows(rows).mean(axis=0)
    host_exchange.start_in_program(ex, self.key(p), "gather",
                                   list(self.compression.encode(mean, F32)), where)

  def receive(self, p: int, m: int):
    """This member's share of fragment ``p``'s averaged pseudo-gradient (f32, ``m`` values)."""
    ex, where = self.exchange()
    members = mpi_axis.lookup(self.axes).size
    if self.compression is None:
      (total,) = host_exchange.finish_in_program(ex, self.key(p), "sum",
                                                 [jax.ShapeDtypeStruct((m,), F32)], where)
      return total / jnp.float32(members)
    c = self._chunks(m)[1] if self.staged else m
    like = jax.eval_shape(lambda x: self.compression.encode(x, F32),
                          jax.ShapeDtypeStruct((c,), F32))
    rows = self._decode_rows(host_exchange.finish_in_program(ex, self.key(p), "gather",
                                                             list(like), where))
    return rows.reshape(-1)[:m] if self.staged else rows.mean(axis=0)
