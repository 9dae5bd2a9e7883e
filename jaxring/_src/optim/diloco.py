"""DiLoCo-class training: the slow level synchronized every H steps, not every step.

Each member of the slow axis (``node``) trains on its own for ``every`` inner steps, its gradients
reduced over the fast levels only, with the inner optimizer. At a sync it averages over the slow
axis its pseudo-gradient, what the outer parameters lost since the last sync (``outer - local``),
compressed and with error feedback if asked; the outer optimizer (SGD with Nesterov momentum by
default) steps the outer parameters with it, and every member restarts from them, keeping its
inner optimizer state (Douillard et al. 2023, DiLoCo). With ``every=1`` the gradients are
averaged over the slow axis before the inner step (the pseudo-gradients then agree), so with
``outer=optax.sgd(1.0)`` and no codec this is synchronous data parallel for any inner optimizer
(averaging each member's Adam update instead would not be).

Streaming (Douillard et al. 2025): with ``fragments=P`` the parameters are cut into ``P``
fragments of about equal bytes (whole leaves, in tree order); fragment ``p`` syncs at the inner
steps ``t`` (counted from the end of the warm-up, from 1) where ``(t - p * every // P) % every ==
0``, so the syncs are spread over the interval. With ``delay=τ`` a fragment's averaged
pseudo-gradient is applied ``τ`` inner steps after it was taken: the member keeps the inner
progress it made meanwhile, ``local <- outer_new + (local_now - local_at_send)``.

``transfer="host"`` (with a ``delay``, the slow axis bound to MPI by
``jaxring.distributed.bind_mpi_axis``; in JAX's shape under ``mpirun`` a mesh axis too): the
pseudo-gradient leaves the step's program and a host thread moves it over MPI while the next
``delay`` inner steps run (jaxring._src.transport.host_exchange); the outer step is taken when
it arrives. XLA:CPU runs no collective beside a program's computation nor a second program
beside it, so this is the form whose transfer overlaps the steps. Uncompressed, the members'
pseudo-gradients are summed (``Iallreduce``); with a codec (plus the residual, which keeps what
the codec left out of a member's own) the bytes are a ring's, in two stages
(jaxring._src.optim.diloco_host).

``warmup_steps``: synchronous data parallel first (gradients averaged over the slow axis too,
the outer parameters following the model), as post-local SGD starts (Lin et al. 2020).

The transform is an ``optax.GradientTransformation`` over one member's values: call it inside a
``shard_map`` (or ``pmap``) whose axes include ``axis``, where its state is each member's own
(the residuals and, between syncs, the parameters differ between members of the slow axis).
"""
from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxring._src import vma
from jaxring._src.collectives import axis_names, pmean, validate_compression
from jaxring._src.error_feedback import bound, is_sparsifying, mean_with_error, zeros_per_member
from jaxring._src.optim.diloco_host import HostSync
from jaxring._src.optim.diloco_parts import (MEMORIES, PLAN_ATTR, check_memory, check_slow,
                                             fragment_of, host_transfers_traced, placed,
                                             spanned)
from jaxring._src.optim.diloco_share import Cut, pseudo_of, size, whole_flat

TRANSFERS = ("program", "host")
SHARDS = ("none", "optimizer")
# the residual's default decay under a sparsifying codec (SparseLoCo's beta): on bench tta's
# ResNet top-k 1% under the Nesterov outer step reached 40% at 1, 67-71% at 0.95-0.9 (design.md)
SPARSE_DECAY = 0.95
_instances = itertools.count()


class DiLoCoState(NamedTuple):
  """State of :func:`diloco`.

  Attributes:
    count: inner steps taken (int32).
    inner: the inner optimizer's state.
    outer_params: the parameters as of the last sync (the same on every member); with
      ``shard="optimizer"`` this member's flat share of each fragment's.
    outer: the outer optimizer's state, one per fragment (of the share, so split).
    residual: this member's error-feedback residual of the pseudo-gradient (None without a codec
      or without error feedback; so split too).
    pending: with ``delay``: per fragment, what applying the outer parameters waiting adds to
      the member's (new outer minus local when sent; with ``shard="optimizer"`` its share,
      flat); with ``transfer="host"`` the local parameters when sent, the outer step waiting
      for the transfer (None without a delay).
    local: None here; in a :func:`jaxring.train_step`'s state, each replica's own parameters
      (the state's ``params`` then being the outer ones; jaxring._src.train.diloco_layout).
    local_stats: likewise its own BatchNorm statistics (the state's as of the last sync).
  """

  count: Any
  inner: Any
  outer_params: Any
  outer: Any
  residual: Any = None
  pending: Any = None
  local: Any = None
  local_stats: Any = None


def diloco(inner: optax.GradientTransformation, *, axis: Any = "node", every: int,
           outer: optax.GradientTransformation | None = None, compression: Any = None,
           error_feedback: bool = True, residual_decay: float | None = None, fragments: int = 1,
           delay: int = 0, warmup_steps: int = 0, algorithm: Any = "auto", fast_axes: Any = (),
           transfer: str = "program", shard: str = "none",
           outer_memory: str = "device") -> optax.GradientTransformation:
  """An optax transformation that syncs the slow axis every ``every`` steps (see the module
  docstring).

  Args:
    inner: the optimizer of the inner steps (e.g. ``optax.adamw(lr)``), on gradients already
      reduced over the fast levels.
    axis: the slow axis name(s) the pseudo-gradients are averaged over.
    every: inner steps between two syncs of a fragment (H).
    outer: the outer optimizer; default ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
    compression: the pseudo-gradients' codec (as :func:`jaxring.psum`; a dict per level too).
    error_feedback: with a lossy codec, carry each member's compression error to its next sync.
    residual_decay: the residual is multiplied by this at each sync before the pseudo-gradient
      is added (SparseLoCo's ``beta``: ``e <- beta * e + delta``), in (0, 1]; 1 keeps all of
      it. Default: ``SPARSE_DECAY`` with a sparsifying codec (``topk_chunks``: what it holds
      back, kept whole, comes out in bursts the outer momentum multiplies) and ``every > 1``,
      else 1 (``every=1`` is per-step error feedback, as :func:`jaxring.reduce_gradients`).
    fragments: streaming syncs: the parameters in this many fragments, synced in turn.
    delay: inner steps between taking a fragment's pseudo-gradient and applying its result.
    warmup_steps: synchronous data-parallel steps first.
    algorithm: the pseudo-gradients' reduction (as :func:`jaxring.psum`).
    fast_axes: axes over which the parameters are the same on every member (the fast levels a
      replicated model spans, e.g. ``"local"``): this changes the plan, not the result: each
      member averages only its ``1/size`` share of a fragment over the slow axis (sends that
      over the slow links, in the program or, with ``transfer="host"``, by the host thread) and
      an ``all_gather`` over the fast axes puts the shares back together (``()`` or ``None``:
      none).
    transfer: ``"program"``: the sync inside the step's program; ``"host"``: by a host thread
      during the ``delay`` steps (needs ``delay >= 1`` and the slow axis bound to MPI; the
      ``fast_axes`` bound to MPI too, one process a device, or by a ``shard_map`` over each
      process's devices, JAX's shape launched by ``mpirun``: each device moves its share).
    shard: ``"none"``: every member keeps the whole outer state; ``"optimizer"`` (with
      ``fast_axes``): each keeps only its share of the outer parameters, the outer optimizer's
      state and the residual, flat per fragment, and takes the outer step on it (the outer
      optimizer must be elementwise, as SGD, Nesterov and Adam are). Call ``init`` and
      ``update`` where the fast axes are bound; under ``jaxring.train_step`` (a TrainState, an
      ``nnx.Optimizer``) the outer parameters are the state's ``params``, whole, and the step
      cuts the rest.
    outer_memory: ``"host"``: the outer parameters, the outer optimizer's state and the
      residual, which only a sync reads, are kept in host memory (on a GPU, pinned host memory)
      and brought to the device for a sync only; ``"device"`` keeps them there. Under
      ``jaxring.train_step`` the outer parameters are the state's ``params`` (the model) and
      stay on the device. Not over MPI-bound axes (nor ``transfer="host"``): jax cannot lower
      a move to host memory beside their ordered effects.

  Returns:
    An ``optax.GradientTransformation``; ``update(grads, state, params)`` needs ``params``.

  Example:
    >>> tx = jaxring.diloco(optax.adamw(3e-4), axis="node", every=100,
    ...                     compression=jaxring.codecs.int8())
  """
  if int(every) < 1:
    raise ValueError(f"diloco: every must be >= 1 inner step, got {every!r}")
  if int(fragments) < 1 or int(delay) < 0 or int(warmup_steps) < 0:
    raise ValueError(f"diloco: fragments >= 1, delay >= 0 and warmup_steps >= 0; got "
                     f"fragments={fragments!r}, delay={delay!r}, warmup_steps={warmup_steps!r}")
  if int(delay) >= int(every):
    raise ValueError(f"diloco: delay={delay} must be below every={every}: a fragment's result "
                     "is applied before its next sync is taken")
  if transfer not in TRANSFERS:
    raise ValueError(f"diloco: transfer must be one of {TRANSFERS}, got {transfer!r}")
  host = transfer == "host"
  if host and int(delay) < 1:
    raise ValueError("diloco(transfer='host') moves a fragment during the inner steps after it "
                     "was sent: give delay >= 1 (the steps it may take)")
  if host and compression is not None and not getattr(compression, "per_hop", True):
    raise NotImplementedError(f"diloco(transfer='host') gathers each member's encoded "
                              f"pseudo-gradient; {compression!r} wraps the whole all-reduce "
                              "instead: use transfer='program' with it")
  if outer_memory not in MEMORIES:
    raise ValueError(f"diloco: outer_memory must be one of {MEMORIES}, got {outer_memory!r}")
  check_memory(outer_memory, (), host)
  if shard not in SHARDS:
    raise ValueError(f"diloco: shard must be one of {SHARDS}, got {shard!r}")
  sharded = shard == "optimizer"
  fast_axes = () if fast_axes is None else fast_axes   # None: none, as ()
  if sharded and int(every) == 1 and compression is not None and error_feedback:
    raise ValueError("diloco(every=1) averages the gradients themselves, whose residual "
                     "shard='optimizer' does not split: use shard='none' at every=1")
  if sharded and not axis_names(fast_axes):
    raise ValueError("diloco(shard='optimizer') splits the outer state over the fast axes: "
                     "name them, e.g. fast_axes='local' (the axes a replicated model spans)")
  if residual_decay is None:
    residual_decay = SPARSE_DECAY if is_sparsifying(compression) and int(every) > 1 else 1.0
  if not 0.0 < float(residual_decay) <= 1.0:
    raise ValueError(f"diloco: residual_decay must be in (0, 1], got {residual_decay!r}")
  validate_compression(compression)
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer
  axes = axis_names(axis)
  every, fragments, delay, warmup = int(every), int(fragments), int(delay), int(warmup_steps)
  lossy = compression is not None and getattr(compression, "lossy", True)
  keeps_residual = bool(error_feedback) and lossy

  align = (getattr(compression, "align", 1) or 1) if compression is not None else 1
  cut = Cut(fast_axes, align, sharded=sharded, host=host, outer=outer)
  shares, split_params = cut.shares, cut.split_params
  hosted = HostSync(axes, compression, delay, next(_instances), shares) if host else None
  offload = outer_memory == "host"

  def home(tree, params=False):
    """The outer state (``params``: the outer parameters) where it is kept between syncs."""
    if not offload or (params and spanned()[1]):   # a train step's params are its model
      return tree
    return placed(tree, "host")

  def fetch(tree):   # the outer state on the device, for a sync
    return placed(tree, "device") if offload else tree

  def settled(state: DiLoCoState) -> DiLoCoState:
    return state._replace(outer_params=home(state.outer_params, params=True),
                          outer=home(state.outer), residual=home(state.residual))

  def _pending(pieces, later=False):
    """Per fragment, with ``transfer="host"``: the local parameters when sent (the outer step
    waits for the transfer); else what applying the outer parameters waiting adds to the
    member's (zeros until a sync; with ``shard="optimizer"`` its share, flat, whole if
    ``later``: Cut.move)."""
    if host:
      return tuple((tuple(p),) for p in pieces)
    if sharded:
      flats = [whole_flat(p) for p in pieces] if later else cut.kept_outer(pieces)
      return tuple((jnp.zeros(np.shape(f), jnp.float32),) for f in flats)
    return tuple((tuple(jnp.zeros_like(x) for x in p),) for p in pieces)

  def host_send(p, mine, res_p):
    """Starts fragment ``p``'s transfer, ``mine`` this member's share of its pseudo-gradient;
    returns its next residual (or None)."""
    if res_p is not None:
      res_p = decayed(res_p)
      mine = mine + cut.residual_share(res_p)
    sent = hosted.send(p, mine)
    # the residual keeps what the codec left out of this member's share; the others' shares
    # are their senders' to carry
    return None if res_p is None else cut.residual_kept(mine - sent, res_p)

  def at(t, lag):   # inner step t (from 1 after the warm-up) lies lag steps after a sync time
    return ((t - lag) % every == 0) & (t - lag > 0)

  def parts(tree, frag_of):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return [[x for x, f in zip(leaves, frag_of) if f == p] for p in range(fragments)], treedef

  def join(pieces, frag_of, treedef):
    its = [iter(p) for p in pieces]
    return jax.tree_util.tree_unflatten(treedef, [next(its[f]) for f in frag_of])

  def init(params):
    frag_of = fragment_of(params, fragments)
    pieces, _ = parts(params, frag_of)
    own = set(axes if bound(axes) else ())
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(params))
    if sharded:
      own |= set(shares().axes if bound(shares().axes) else ())
      # eager and outside the fast axes (a TrainState's or an nnx.Optimizer's init): the
      # fragments whole, for a train step to cut (split_flats); update refuses it elsewhere
      later = not traced and not shares().bound_here()
      flats = tuple(whole_flat(x) for x in pieces) if later else cut.kept_outer(pieces)
      outer_kept = params if later else flats
      residual = tuple(jnp.zeros_like(x, jnp.float32) for x in flats) if keeps_residual \
          else None
      outer_states = tuple(outer.init([x]) for x in flats)
    else:
      outer_kept = params
      residual = zeros_per_member(params, axes) if keeps_residual else None
      outer_states = tuple(outer.init(p) for p in pieces)
    pending = _pending(pieces, sharded and later) if delay else None
    state = DiLoCoState(jnp.zeros((), jnp.int32), inner.init(params), outer_kept, outer_states,
                        residual, pending)
    # each member's own (update's results are typed so; a scan over steps needs both alike)
    varying = own.union(*(vma.varying_axes(x) for x in jax.tree_util.tree_leaves(params)))
    varying = tuple(sorted(varying, key=str))
    state = jax.tree_util.tree_map(lambda x: vma.pvary(x, varying), state)
    # in a program (a scan's carry must keep its types); an eager init's stays on the device,
    # for a train step to lay out, and the first update moves it
    return settled(state) if traced else state

  def decayed(residual):   # e <- beta * e, before this sync's pseudo-gradient joins it
    if residual is None or float(residual_decay) == 1.0:
      return residual
    return jax.tree_util.tree_map(lambda r: r * jnp.asarray(residual_decay, r.dtype), residual)

  def sync(pseudo, residual):
    """The pseudo-gradient averaged over the slow axis (and the residual carried)."""
    residual = decayed(residual)
    if compression is None:
      return pmean(pseudo, axes, algorithm=algorithm), residual
    if residual is None:
      return pmean(pseudo, axes, algorithm=algorithm, compression=compression), None
    return mean_with_error(pseudo, residual, axes, algorithm=algorithm, compression=compression)

  def outer_sync(local_p, outer_p, ostate, res_p):
    """A fragment's sync in the program: (the new outer parameters whole, or with a ``delay``
    their Cut.move, as kept, the outer state, the residual)."""
    slow_mean = (lambda v, r: (v, r)) if every == 1 else sync  # noqa: E731 (averaged already)
    if shares().axes:   # each member its share, over the slow axis; gathered back
      res = cut.residual_share(res_p)
      (avg,), res = slow_mean([cut.pseudo_share(outer_p, local_p)], None if res is None else [res])
      new, kept, ostate = cut.outer_from_share(avg, ostate, outer_p, local_p, whole=not delay)
      return (cut.move(new, local_p) if delay else new, kept, ostate,
              None if res is None else cut.residual_kept(res[0], res_p))
    avg, res_p = slow_mean(pseudo_of(outer_p, local_p), res_p)
    new_outer, ostate = cut.outer_step(avg, ostate, outer_p)
    whole = [n.astype(x.dtype) for n, x in zip(new_outer, local_p)]
    return cut.move(whole, local_p) if delay else whole, new_outer, ostate, res_p

  def update(grads, state: DiLoCoState, params=None):
    if params is None:
      raise ValueError("diloco: update(grads, state, params) needs the parameters")
    check_slow(axes)
    check_memory(outer_memory, axes + shares().axes)
    frag_of = fragment_of(params, fragments)
    if sharded:   # an init outside the fast axes keeps whole fragments, for a train step to cut
      cut.check_cut(state, [size(p) for p in parts(params, frag_of)[0]])
    count = state.count
    # every value here is this member's: typed varying over every axis anything varies over, so
    # that the branches of a sync and of no sync have one type (shard_map(check_vma=True))
    varying = tuple(sorted(set(axes if bound(axes) else ()).union(*(
        vma.varying_axes(x) for x in jax.tree_util.tree_leaves((grads, params, state)))), key=str))

    def cond(pred, on_true, on_false, operand):
      vary = lambda f: lambda op: jax.tree_util.tree_map(  # noqa: E731
          lambda x: vma.pvary(x, varying), f(op))
      return lax.cond(pred, vary(on_true), vary(on_false), operand)

    def warm(_):   # synchronous data parallel over the slow axis too; the outer follows
      g = pmean(grads, axes, algorithm=algorithm)
      updates, inner_state = inner.update(g, state.inner, params)
      new = optax.apply_updates(params, updates)
      pieces = parts(new, frag_of)[0]
      return updates, settled(state._replace(
          count=count + 1, inner=inner_state,
          outer_params=cut.kept_outer(pieces) if split_params() else new,
          pending=_pending(pieces) if delay else None))

    def local(_):
      g, residual = grads, state.residual
      if every == 1:   # each step syncs: the gradients averaged first, so that any inner
        g, residual = sync(grads, fetch(residual))   # optimizer steps as in synchronous DP
        residual = home(residual)
      updates, inner_state = inner.update(g, state.inner, params)
      new = optax.apply_updates(params, updates)
      t = count - warmup + 1                     # this inner step's number after the warm-up
      pieces, treedef = parts(new, frag_of)
      frags = lambda x, split: list(x) if split else parts(x, frag_of)[0]  # noqa: E731
      outer_pieces = frags(state.outer_params, split_params())
      residuals = None if residual is None else frags(residual, sharded)
      outer_states = list(state.outer)
      pending = None if state.pending is None else list(state.pending)
      for p in range(fragments):
        offset = p * every // fragments
        due, arrives = at(t, offset), at(t, offset + delay)   # sent / its result back
        if (host or sharded) and not pieces[p]:   # more fragments than leaves: nothing to move
          continue
        res_p = None if residuals is None else residuals[p]
        if host and not host_transfers_traced():   # a step with none (plan's host_steps)
          continue
        if host:
          def arrive(args, p=p):   # the transfer is back: the outer step, the progress kept
            x_p, outer_p, ostate, sent = args
            avg = hosted.receive(p, shares().layout(size(x_p))[1])
            whole, outer_p, ostate = cut.outer_from_share(avg, *fetch((ostate, outer_p)), x_p)
            return ([(w + (x - s)).astype(x.dtype) for w, x, s in zip(whole, x_p, sent)],
                    home(outer_p, params=True), home(ostate))

          def send(args, p=p):
            local_p, outer_p, res_p = fetch(args)
            return home(host_send(p, cut.pseudo_share(outer_p, local_p), res_p))

          (sent_from,) = pending[p]
          pieces[p], outer_pieces[p], outer_states[p] = cond(
              arrives, arrive, lambda a: a[:3],
              (pieces[p], outer_pieces[p], outer_states[p], list(sent_from)))
          if hosted.staged:   # stage 2: this member's chunk averaged, its gather started
            m = shares().layout(size(pieces[p]))[1]
            cond(at(t, offset + hosted.midway), lambda _, p=p, m=m: hosted.reduce(p, m),
                 lambda _: None, None)
          res_p = cond(due, send, lambda a: a[2], (pieces[p], outer_pieces[p], res_p))
          pending[p] = (tuple(jnp.where(due, x, s) for x, s in zip(pieces[p], sent_from)),)
        else:
          if delay:   # a result sent ``delay`` steps ago arrives: applied, the progress kept
            pieces[p] = cond(arrives, lambda a: cut.moved(*a), lambda a: list(a[1]),
                             (pending[p][0], pieces[p]))

          def do_sync(args):   # (the new outer parameters whole or their move, as kept, ...)
            local_p, outer_p, ostate, res_p = fetch(args[:4])   # (args[4]: the pending move)
            result, outer_p, ostate, res_p = outer_sync(local_p, outer_p, ostate, res_p)
            return result, home(outer_p, params=True), home(ostate), home(res_p)

          result, outer_pieces[p], outer_states[p], res_p = cond(
              due, do_sync, lambda a: (a[4] if delay else a[0], *a[1:4]),
              (pieces[p], outer_pieces[p], outer_states[p], res_p,
               pending[p][0] if delay else None))
          if delay:   # applied later; until then the member goes on from its own parameters
            pending[p] = (result,)
          else:
            pieces[p] = result
        if residuals is not None:
          residuals[p] = res_p
      new_params = join(pieces, frag_of, treedef)
      updates = jax.tree_util.tree_map(lambda a, b: (a - b).astype(b.dtype), new_params, params)
      kept = lambda x, split: tuple(x) if split else join(x, frag_of, treedef)  # noqa: E731
      return updates, settled(state._replace(
          count=count + 1, inner=inner_state, outer_params=kept(outer_pieces, split_params()),
          outer=tuple(outer_states),
          residual=None if residuals is None else kept(residuals, sharded),
          pending=None if pending is None else tuple(pending)))

    state = settled(state)   # (from init, or restored from a checkpoint, on the device)
    if not warmup:
      return local(None)
    return cond(count < warmup, warm, local, None)

  def first_fragment_syncs(count):   # a warm-up step, or fragment 0's sync
    t = count - warmup + 1
    return (t <= 0) | at(t, 0)

  def host_steps(count: int) -> bool:   # the step after count starts or finishes a transfer
    lags = (0, delay, *((hosted.midway,) if hosted.staged else ()))
    return count >= warmup and any(at(count - warmup + 1, p * every // fragments + d)
                                   for p in range(fragments) for d in lags)

  setattr(update, PLAN_ATTR, {"axes": axes, "syncs": first_fragment_syncs,
                              "split": cut.split_flats if sharded else None,
                              "host_steps": host_steps if host else None})
  return optax.GradientTransformation(init, update)
