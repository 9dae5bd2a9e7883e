"""A member's share of a fragment over the fast axes (:func:`jaxring.diloco`'s ``fast_axes``).

The members of the fast axes hold the same parameters (a replicated model spans them), so each
can take its own ``1/size`` of a fragment's flat values without any exchange, and what they
computed on their shares an ``all_gather`` over the fast axes puts back together. Two things cut
the fragments so: ``shard="optimizer"`` (a member keeps and steps only its share of the outer
parameters, of the outer optimizer's state and of the residual) and ``transfer="host"`` (a
member moves only its share over the slow links).

A share is ``m`` consecutive values of the fragment's flat, zero-padded to ``size * m``, where
``m`` is a multiple of the codec's ``align`` (its blocks then never straddle two members).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxring._src import fuse
from jaxring._src.collectives import all_gather, axis_names
from jaxring._src.optim.diloco_parts import spanned
from jaxring._src.transport import binding as binding_mod


class Shares:
  """The shares of ``fast_axes`` (none: one member holding everything).

  Args:
    fast_axes: the axes whose members hold the same parameters.
    align: a share's length is a multiple of it.
    host: a host transfer's (only the message differs: the fast axes bound to MPI, or by a
      ``shard_map`` over each process's own devices).
  """

  def __init__(self, fast_axes, align: int = 1, *, host: bool = False):
    self.axes = axis_names(fast_axes)
    self.align = max(int(align or 1), 1)
    self.host = host

  def bound_here(self) -> bool:
    """Whether the fast axes are bound here (by ``shard_map``/``pmap`` or to MPI)."""
    try:
      return not self.axes or binding_mod.bind(self.axes, "diloco") is not None
    except NameError:
      return False

  def member(self):
    """(this member's index along the fast axes, their members): an int, or traced under
    ``shard_map``."""
    if not self.axes:
      return 0, 1
    try:
      bound = binding_mod.bind(self.axes, "diloco")
    except NameError:
      bound = None
    if bound is None:
      where = ("bind them with jaxring.distributed.bind_mpi_axis or a shard_map over each "
               "process's devices, or leave fast_axes empty (every member then sends the whole "
               "fragment)" if self.host else
               "call the transformation's init and update inside the shard_map (or pmap) whose "
               "axes include them, or bind them with jaxring.distributed.bind_mpi_axis")
      raise ValueError(f"diloco: the fast axes {self.axes} are not bound here; {where}")
    if bound.lax_bound:
      return lax.axis_index(self.axes), bound.size
    return bound.rank, bound.size

  def layout(self, n: int):
    """(this member's offset, its share's length, the padded length) of an ``n``-value flat."""
    r, k = self.member()
    m = -(-n // (k * self.align)) * self.align
    return r * m, m, k * m

  def take(self, flat):
    """This member's share of ``flat`` (1-D)."""
    n = flat.shape[0]
    start, m, total = self.layout(n)
    return lax.dynamic_slice(jnp.pad(flat, (0, total - n)), (start,), (m,))

  def place(self, share, n: int):
    """``share`` at this member's place in zeros of ``n`` values (its part of a whole)."""
    start, _, total = self.layout(n)
    return lax.dynamic_update_slice(jnp.zeros((total,), share.dtype), share, (start,))[:n]

  def gather(self, share, n: int):
    """The ``n`` values whose shares the members hold (``share`` is this member's)."""
    if self.member()[1] == 1:
      return share[:n]
    return all_gather(share, self.axes, tiled=True)[:n]


def flat(piece):
  """A fragment's leaves, flat in f32."""
  return fuse.concat(piece, range(len(piece)), jnp.float32)


def size(piece) -> int:
  return sum(int(np.size(x)) for x in piece)


def whole_flat(piece):
  """A fragment's values, flat in their dtype (f32 if they differ)."""
  if not piece:
    return jnp.zeros((0,), jnp.float32)
  return fuse.concat(piece, range(len(piece)), jnp.result_type(*piece))


def pseudo_of(outer_p, local_p):
  """A fragment's pseudo-gradient: what the outer parameters lost since the last sync (f32)."""
  return [o.astype(jnp.float32) - x.astype(jnp.float32) for o, x in zip(outer_p, local_p)]


class Cut:
  """How a :func:`jaxring.diloco` sync cuts a fragment over the fast axes (``fast_axes`` and
  those a train step says its model spans): each member's share of the pseudo-gradient, and
  with ``sharded`` (``shard="optimizer"``) of the outer state it keeps. Under a train step the
  outer parameters are the step's ``params``, whole; only the outer optimizer's state and the
  residual are then cut."""

  def __init__(self, fast_axes, align: int, *, sharded: bool, host: bool, outer):
    self.fast, self.align, self.sharded, self.host, self.outer = (
        axis_names(fast_axes), align, sharded, host, outer)
    self.made: dict = {}

  def shares(self) -> Shares:
    fast = tuple(dict.fromkeys(self.fast + spanned()[0]))
    if fast not in self.made:
      self.made[fast] = Shares(fast, self.align, host=self.host)
    return self.made[fast]

  def split_params(self) -> bool:
    """Whether the state keeps its share of the outer parameters (not under a train step)."""
    return self.sharded and not spanned()[1]

  def share_of(self, piece):
    """This member's share of a fragment's values, in their dtype (f32 if they differ)."""
    return self.shares().take(whole_flat(piece))

  def kept_outer(self, pieces):
    """With ``shard="optimizer"``, the outer parameters as the state keeps them: per fragment,
    this member's share."""
    return tuple(self.share_of(x) if x else jnp.zeros((0,), jnp.float32) for x in pieces)

  def pseudo_share(self, outer_p, local_p):
    """This member's share of a fragment's pseudo-gradient (f32)."""
    if self.split_params():   # the outer parameters are the share already
      return outer_p.astype(jnp.float32) - self.shares().take(flat(local_p))
    return self.shares().take(flat(pseudo_of(outer_p, local_p)))

  def residual_share(self, res_p):
    """This member's share of a fragment's residual (kept so with ``shard="optimizer"``; else
    the leaves, zero outside the share)."""
    return res_p if self.sharded or res_p is None else self.shares().take(flat(res_p))

  def residual_kept(self, err, res_p):
    """``err``, this member's share of the next residual, as the state keeps it."""
    if self.sharded or err is None:
      return err
    err = self.shares().place(err, size(res_p))
    return [e.astype(r.dtype) for e, r in zip(fuse.split(err, res_p, range(len(res_p))), res_p)]

  def outer_step(self, avg, ostate, outer_p):
    """The outer optimizer's step with the averaged pseudo-gradient: (new outer, its state)."""
    upd, ostate = self.outer.update([a.astype(o.dtype) for a, o in zip(avg, outer_p)], ostate,
                                    outer_p)
    return optax.apply_updates(outer_p, upd), ostate

  def outer_from_share(self, avg, ostate, outer_p, local_p, *, whole: bool = True):
    """The outer step from this member's share ``avg`` of a fragment's averaged
    pseudo-gradient: (the new outer parameters whole, as kept, the outer state). With
    ``whole=False`` and ``shard="optimizer"`` the first is this member's share of them (what
    :meth:`move` takes), gathered only where the state keeps them whole."""
    n, idxs = size(local_p), range(len(local_p))
    if self.sharded:   # the step on the share; the members' new shares put together
      mine = outer_p if self.split_params() else self.share_of(outer_p)
      (new,), ostate = self.outer_step([avg], ostate, [mine])
      gathered = None
      if whole or not self.split_params():
        gathered = fuse.split(self.shares().gather(new, n), local_p, idxs)
        gathered = [w.astype(x.dtype) for w, x in zip(gathered, local_p)]
      return gathered if whole else new, new if self.split_params() else gathered, ostate
    new, ostate = self.outer_step(
        fuse.split(self.shares().gather(avg, n), outer_p, idxs, jnp.float32), ostate, outer_p)
    return new, new, ostate

  def move(self, new, local_p):
    """What applying the new outer parameters ``new`` (``outer_from_share(whole=False)``'s, as
    they are when sent) adds to a member's ``local_p``: with ``shard="optimizer"`` its share,
    flat in f32 (gathered at arrival by :meth:`moved`), else per leaf, in its dtype."""
    if self.sharded:
      return new.astype(jnp.float32) - self.shares().take(flat(local_p))
    return tuple((w - x).astype(x.dtype) for w, x in zip(new, local_p))

  def moved(self, move, local_p):
    """``local_p`` with a pending :meth:`move` applied (the inner progress since it was sent
    kept)."""
    if self.sharded:
      move = fuse.split(self.shares().gather(move, size(local_p)), local_p,
                        range(len(local_p)), jnp.float32)
    return [(x + m).astype(x.dtype) for x, m in zip(local_p, move)]

  def split_flats(self, tree):
    """An outer state made outside the fast axes for a train step to lay out, inside its
    ``shard_map``: each fragment's flat (a 1-D leaf) cut to this member's share."""
    return jax.tree_util.tree_map(lambda x: self.shares().take(x) if np.ndim(x) == 1 else x,
                                  tree)

  def check_cut(self, state, sizes) -> None:
    """Refuses a state made outside the fast axes where nothing cut it (``sizes``: the
    fragments' values): a ``shard_map``'s update needs ``init`` inside it too."""
    shares, fields = self.shares(), [state.outer, state.residual or (None,) * len(sizes)]
    if self.split_params():
      kept = state.outer_params
      fields.append(kept if isinstance(kept, tuple) and len(kept) == len(sizes)
                    and all(np.ndim(x) == 1 for x in kept) else (np.zeros(()),) * len(sizes))
    for n, trees in zip(sizes, zip(*fields)):
      lengths = {np.shape(x)[0] if np.ndim(x) == 1 else -1 for x in jax.tree_util.tree_leaves(
          trees[2:]) + [x for x in jax.tree_util.tree_leaves(trees[:2]) if np.ndim(x) == 1]}
      if lengths - {shares.layout(n)[1]}:
        raise ValueError(
            f"diloco(shard='optimizer'): the state holds whole fragments ({n} values, not this "
            f"member's share of {shares.layout(n)[1]}): its init ran outside the fast axes "
            f"{shares.axes}. Call init inside the shard_map (or pmap) whose axes include them; "
            "@jaxring.train_step cuts a TrainState's or an nnx.Optimizer's itself, not the "
            "functional form's (shard='none' there)")
