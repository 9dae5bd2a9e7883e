"""``@jaxring.train_step`` on a Flax NNX step: ``step(model, optimizer, batch, *args) -> metrics``.

NNX users write a step that updates its objects in place (as under ``nnx.jit``). The decorator
runs it as the functional step it already knows: the NNX objects among the arguments (the model,
its ``nnx.Optimizer``, metrics) are read into an :class:`NnxState` — the model's parameters
(the optimizer's ``wrt``) and the optimizer's state as its optax transformation sees them, the
averaged variables and the rest: the layout of a Linen ``TrainState``, so that sharding, error
feedback, loss scaling and checkpoints serve both alike — the step traced once through
:func:`adapter`, which merges the objects back from that state inside each replica, calls the
user's function and splits them again; the results are written back into the objects' own
Variables. The first non-NNX argument is the batch (split over the replicas), the others reach
every replica whole.

The walk of the object graph is done once (:class:`Binding`, kept while the objects keep their
structure, as ``nnx.cached_partial`` keeps its cache): a call reads and writes the Variables it
found then, nothing more.

What differs from a ``TrainState`` step:
- error-feedback residuals live in the optimizer, ``optimizer.residuals`` (:class:`Residual`
  Variables shaped ``(replicas, *param.shape)``, one row per replica), so ``nnx.state``,
  ``nnx.split`` and checkpoints of the optimizer hold them;
- float variables of the model and of other NNX objects that are neither parameters nor
  optimizer state (``nnx.BatchStat``, ``nnx.metrics`` totals) are averaged over the replicas
  after the step; integer ones (counts) are each replica's, equal on all of them;
- every ``nnx.RngKey`` is folded with the replica's index inside the step (dropout masks differ
  per replica, as their batches do) and kept as it was outside it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxring._src.train import diloco_layout, guards
from jaxring._src.train.nnx_graph import is_graph_node, nnx_module, pure
from jaxring._src.train.precision import DynamicLossScale
from jaxring._src.train.state import remapped, residual_tree, with_residual_tree

FIELDS = ("params", "opt_state", "batch_stats", "model_rest", "step")


def residual_type():
  """The Variable type of ``optimizer.residuals`` (defined on first use: flax is imported)."""
  global _RESIDUAL
  if _RESIDUAL is None:
    nnx = nnx_module()

    class Residual(nnx.Variable):
      """One replica row per replica of a parameter's error-feedback residual (jaxring)."""

    Residual.__module__ = "jaxring.train"
    _RESIDUAL = Residual
  return _RESIDUAL


_RESIDUAL = None
_LOSS_SCALE = None


def loss_scale_type():
  """The Variable type of ``optimizer.loss_scale`` (fp16's dynamic loss scale: its ``scale`` and
  ``good_steps``)."""
  global _LOSS_SCALE
  if _LOSS_SCALE is None:
    class LossScale(nnx_module().Variable):
      """A field of the dynamic loss scale of an fp16 train step (jaxring)."""

    LossScale.__module__ = "jaxring.train"
    _LOSS_SCALE = LossScale
  return _LOSS_SCALE


@struct.dataclass
class NnxState:
  """An NNX step's objects as the functional step sees them: the model's parameters and the
  optimizer's state as its optax transformation sees them (``nnx.pure``), the other variables
  as nested dicts by path (``batch_stats``: the float ones, averaged over the replicas)."""

  params: Any
  opt_state: Any
  batch_stats: Any
  model_rest: Any
  step: Any = 0
  tx: Any = struct.field(pytree_node=False, default=None)       # what the step's optimizer runs
  own_tx: Any = struct.field(pytree_node=False, default=None)   # the optimizer's own
  residuals: Any = struct.field(pytree_node=False, default=None)
  loss_scale: Any = None


def _nest(items) -> dict:
  """``{path: value}`` as nested dicts."""
  out: dict = {}
  for path, value in items:
    d = out
    for k in path[:-1]:
      d = d.setdefault(k, {})
    d[path[-1]] = value
  return out


@dataclasses.dataclass(eq=False)
class Binding:
  """The object graph of one call's NNX arguments, walked once."""

  positions: tuple        # the call's arguments that are NNX objects
  nodes: tuple            # those objects
  model: int              # index among them of the model, and of the optimizer (or None)
  optimizer: int | None
  graphdef: Any
  treedef: Any            # of the joint nnx.State, leaves in ``variables`` order
  variables: list         # the live Variables
  kinds: list             # per variable: a FIELDS name, "residuals" or "loss_scale"
  orders: dict            # field -> (indices into variables in its tree's leaf order, treedef)
  keys: tuple             # indices of the nnx.RngKey variables
  tx: Any                 # the optimizer's own optax transformation

  @classmethod
  def of(cls, args: tuple) -> Binding:
    nnx = nnx_module()
    positions = tuple(i for i, a in enumerate(args) if is_graph_node(a))
    nodes = tuple(args[i] for i in positions)
    opts = [k for k, n in enumerate(nodes) if isinstance(n, nnx.Optimizer)]
    if len(opts) > 1:
      raise ValueError("train_step: the step takes several nnx.Optimizer objects; one optimizer "
                       "updates the model's parameters (combine them with optax.multi_transform)")
    models = [k for k, n in enumerate(nodes) if isinstance(n, nnx.Module)
              and not isinstance(n, nnx.Optimizer)]
    if not models:
      raise TypeError("train_step: an NNX step takes the model (an nnx.Module) among its "
                      "arguments, e.g. step(model, optimizer, batch)")
    opt = opts[0] if opts else None
    wrt = nnx.Param if opt is None else getattr(nodes[opt], "wrt", None)
    if wrt is None:
      raise TypeError("train_step: the nnx.Optimizer has no `wrt`: build it as "
                      "nnx.Optimizer(model, tx, wrt=nnx.Param) (flax >= 0.11)")
    graphdef, state = nnx.split(nodes)
    entries = list(nnx.to_flat_state(state))
    variables = [v for _, v in entries]
    leaves, treedef = jax.tree_util.tree_flatten(state)
    if len(leaves) != len(variables) or any(
        x is not v.get_value() for x, v in zip(leaves, variables)):
      raise RuntimeError("train_step: this flax's nnx.State flattens in another order than its "
                         "flat state; please report the flax version")
    model = models[0]
    where = {id(v): k for k, v in enumerate(variables)}
    kinds: list = [None] * len(variables)
    orders = {}

    def take(field: str, tree) -> None:
      """``field`` is ``tree`` (of live Variables), laid out as ``nnx.pure(tree)``."""
      vs = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
      idx = [where[id(v)] for v in vs]
      for k in idx:
        kinds[k] = field
      orders[field] = (idx, jax.tree_util.tree_structure(pure(tree)) if idx else None)

    # the parameters and the optimizer state as the optimizer's tx sees them (Optimizer.update
    # hands it nnx.pure of both), so a sharded step's whole-leaf view of tx recognises them
    params = nnx.state(nodes[model], wrt)
    take("params", params)
    if opt is not None:
      take("opt_state", nodes[opt].opt_state)
      held = getattr(nodes[opt], "residuals", None)
      if held is not None:    # laid out like the parameters (their paths under "residuals")
        by_path = dict(nnx.to_flat_state(held))
        take("residuals", jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(params, is_leaf=lambda x: isinstance(x, nnx.Variable)),
            [by_path[p] for p, _ in nnx.to_flat_state(params)]))
    keyed = {"batch_stats": [], "model_rest": [], "step": [], "loss_scale": []}
    for k, (path, v) in enumerate(entries):
      if kinds[k] is not None:
        continue
      if path[0] == opt and path[1:] == ("step",):
        kind, key = "step", ("step",)
      elif path[0] == opt and path[1] == "loss_scale":
        kind, key = "loss_scale", path[2:]
      elif path[0] == opt and path[1] == "residuals":
        raise ValueError("train_step: optimizer.residuals does not match the model's parameters "
                         "(restored from another model?): delete it (del optimizer.residuals)")
      elif (jnp.issubdtype(jnp.result_type(v.get_value()), jnp.floating)
            and not isinstance(v, (nnx.RngKey, nnx.Param))):
        kind, key = "batch_stats", path   # averaged over the replicas
      else:   # RNG keys (folded inside the step), counts, parameters the optimizer leaves alone
        kind, key = "model_rest", path
      kinds[k] = kind
      keyed[kind].append((key, k))
    for f, items in keyed.items():
      idx, tdef = jax.tree_util.tree_flatten(_nest(items))
      orders[f] = (idx, tdef)
    orders.setdefault("opt_state", ([], None))
    orders.setdefault("residuals", ([], None))
    keys = tuple(k for k, v in enumerate(variables) if isinstance(v, nnx.RngKey))
    return cls(positions, nodes, model, opt, graphdef, treedef, variables, kinds, orders, keys,
               None if opt is None else nodes[opt].tx)

  def matches(self, args: tuple) -> bool:
    """Whether ``args`` hold the very objects this binding walked, at the same places."""
    return (len(args) > max(self.positions) and
            all(args[p] is n for p, n in zip(self.positions, self.nodes)) and
            sum(is_graph_node(a) for a in args) == len(self.positions))

  def tree(self, field: str, values: list):
    """``field``'s tree of ``values`` (indexed like ``variables``); None where it has none."""
    idx, tdef = self.orders[field]
    if not idx:
      return None
    tree = jax.tree_util.tree_unflatten(tdef, [values[k] for k in idx])
    return tree["step"] if field == "step" else tree

  def read(self) -> NnxState:
    """The objects' current values as an :class:`NnxState` (no graph walk), and the residuals
    (a tree like the parameters, or None)."""
    values = [v.get_value() for v in self.variables]
    fields = {f: self.tree(f, values) for f in FIELDS}
    fields["params"] = fields["params"] or {}
    fields["opt_state"] = fields["opt_state"] or {}
    fields["model_rest"] = fields["model_rest"] or {}
    fields["step"] = 0 if fields["step"] is None else fields["step"]
    scale = self.tree("loss_scale", values)
    if scale is not None:
      scale = DynamicLossScale(scale=scale["scale"], good_steps=scale["good_steps"])
    return (NnxState(**fields, tx=self.tx, own_tx=self.tx, loss_scale=scale),
            self.tree("residuals", values))

  def write(self, state: NnxState, residuals) -> None:
    """Sets the objects' Variables to ``state``'s values (and the residuals')."""
    scale = state.loss_scale
    for f in FIELDS + ("residuals", "loss_scale"):
      tree = {"residuals": residuals, "loss_scale": scale and {
          "scale": scale.scale, "good_steps": scale.good_steps}}.get(f, getattr(state, f, None))
      if f == "opt_state" and self.reshaped(state):
        continue   # attach rebuilds it
      if tree is not None and self.orders[f][0]:
        for k, x in zip(self.orders[f][0], jax.tree_util.tree_leaves(tree)):
          self.variables[k].set_value(x)

  def reshaped(self, state: NnxState) -> bool:
    """Whether the step keeps the optimizer state in another tree than the optimizer holds
    (``jaxring.diloco``'s per-replica rows: jaxring._src.train.diloco_layout)."""
    idx, tdef = self.orders["opt_state"]
    return (self.optimizer is not None and bool(idx)
            and jax.tree_util.tree_structure(state.opt_state) != tdef)

  def attach(self, state: NnxState, residuals) -> bool:
    """Gives the optimizer what the step keeps beside the objects' own variables and they do
    not hold yet (the first step's error-feedback residuals, fp16's loss scale, an optimizer
    state laid out anew): a change of the graph, so the caller walks it again (True)."""
    nnx = nnx_module()
    rebuilt = self.reshaped(state)
    if rebuilt:
      from flax.nnx.training.optimizer import to_opt_state
      self.nodes[self.optimizer].opt_state = nnx.data(to_opt_state(state.opt_state))
    missing = {}
    if residuals is not None and not self.orders["residuals"][0]:
      missing["residuals"] = (residual_type(), residuals)
    if state.loss_scale is not None and not self.orders["loss_scale"][0]:
      missing["loss_scale"] = (loss_scale_type(), {"scale": state.loss_scale.scale,
                                                   "good_steps": state.loss_scale.good_steps})
    if missing and self.optimizer is None:
      raise TypeError(f"train_step: the step keeps its {' and '.join(missing)} in the "
                      "nnx.Optimizer, and this step takes none: pass the optimizer to the step, "
                      "step(model, optimizer, batch)")
    for name, (kind, tree) in missing.items():
      held = jax.tree_util.tree_map(kind, tree)
      setattr(self.nodes[self.optimizer], name,
              nnx.data(held if isinstance(held, nnx.State) else nnx.State(held)))
    return rebuilt or bool(missing)


def adapter(fn: Callable, binding: Binding, axes: tuple, batch_at: int, nargs: int) -> Callable:
  """The user's in-place NNX step as ``f(state: NnxState, batch, *whole) -> (state, metrics)``,
  traced inside each replica."""
  nnx = nnx_module()
  count = len(binding.variables)
  placeholders = {k: binding.variables[k].get_value().dtype
                  for k, kind in enumerate(binding.kinds) if kind not in FIELDS}
  binding = dataclasses.replace(binding, nodes=(), variables=[])   # no objects held

  def step(state: NnxState, batch, *whole):
    values: list = [None] * count
    for f in FIELDS:
      idx, tree = binding.orders[f][0], getattr(state, f)
      if tree is not None:
        for k, x in zip(idx, jax.tree_util.tree_leaves(tree)):
          values[k] = x
    keys = {k: values[k] for k in binding.keys}
    replica = lax.axis_index(axes if len(axes) > 1 else axes[0])
    for k, key in keys.items():   # a key of this replica's own; replicated again after the step
      values[k] = jax.random.fold_in(key, replica)
    for k, dtype in placeholders.items():   # residuals, loss scale: the state's own fields
      values[k] = jnp.zeros((), dtype)
    nodes = nnx.merge(binding.graphdef, jax.tree_util.tree_unflatten(binding.treedef, values))
    swap = binding.optimizer is not None and state.tx is not state.own_tx
    if swap:
      nodes[binding.optimizer].tx = state.tx    # a sharded step's whole-leaf view of tx
    args, it = [None] * nargs, iter(whole)
    for p, node in zip(binding.positions, nodes):
      args[p] = node
    for i in range(nargs):
      if i == batch_at:
        args[i] = batch
      elif args[i] is None:
        args[i] = next(it)
    metrics = fn(*args)
    if swap:
      nodes[binding.optimizer].tx = state.own_tx
    graphdef, out = nnx.split(nodes)
    if graphdef != binding.graphdef:
      raise ValueError(
          "train_step: the NNX step changed the structure of its objects (a Variable or "
          "submodule added, removed or replaced); a step may change values only. Create "
          "every Variable before the first step (as nnx.cached_partial requires)")
    leaves = jax.tree_util.tree_leaves(out)
    for k, key in keys.items():
      leaves[k] = key
    return state.replace(**{f: binding.tree(f, leaves) if binding.orders[f][0]
                            else getattr(state, f) for f in FIELDS}), metrics

  return step


class Runner:
  """What a :class:`~jaxring._src.train.step.TrainStep` does with NNX arguments: the functional
  step made by ``make_step(fn)`` (a TrainStep of the same settings) on the objects' state."""

  #: bindings kept for objects met last (each holds its objects alive: a few, not all)
  KEEP = 8

  def __init__(self, fn: Callable, make_step: Callable, axes: tuple):
    self.fn, self.make_step, self.axes = fn, make_step, axes
    self.binding: Binding | None = None
    self.inner = None
    self.bindings: dict = {}   # the objects' ids -> their Binding, the newest last
    self.steps: dict = {}      # (graph, kinds, call layout) -> its functional TrainStep

  def _bind(self, args: tuple) -> None:
    """The binding of these objects (walked once while they keep their structure) and the
    functional step of their structure: objects used in turn each keep theirs, so a step
    alternating between two models compiles once per model (as ``nnx.jit`` does)."""
    ids = tuple(id(a) for a in args if is_graph_node(a))
    b = self.bindings.pop(ids, None)
    if b is None or not b.matches(args):
      guards.check_call(self.fn, args, "NNX")
      b = Binding.of(args)
    self.bindings[ids] = b
    while len(self.bindings) > self.KEEP:
      self.bindings.pop(next(iter(self.bindings)))
    plain = [i for i in range(len(args)) if i not in b.positions]
    if not plain:
      raise TypeError("train_step: an NNX step takes a batch after its NNX objects, e.g. "
                      "step(model, optimizer, batch); the batch is split over the replicas")
    self.batch_at = plain[0]
    key = (b.graphdef, tuple(b.kinds), b.positions, self.batch_at, len(args))
    try:
      hash(key)
    except TypeError:   # a Module attribute holding a list (unhashable): a step of its own
      key = ("objects", id(b))
    if key not in self.steps:
      self.steps[key] = self.make_step(adapter(self.fn, b, self.axes, self.batch_at, len(args)))
    self.binding, self.inner = b, self.steps[key]

  def prepare(self, objs: tuple) -> tuple:
    """``TrainStep.prepare`` of NNX objects: residuals (and fp16's loss scale) given to the
    optimizer, every Variable placed on the mesh, so that a checkpoint can be restored into
    them (``nnx.state(optimizer)`` then has the residuals' shapes)."""
    state, binding = snapshot(objs)
    return restore_into(objs, binding, self.make_step(lambda *a: None).prepare(
        self._remapped(state, None)))

  def _remapped(self, state: NnxState, inner) -> NnxState:
    """``state`` with residuals saved by another replica count remapped to this one's."""
    residuals = residual_tree(state)
    if residuals is None:
      return state
    replicas = (inner or self.make_step(lambda *a: None)).num_replicas
    return with_residual_tree(state, remapped(residuals, replicas))

  def functional(self, args: tuple) -> tuple:
    """``(state, batch, *whole)``: the functional step's arguments for this call."""
    if self.binding is None or not self.binding.matches(args):
      self._bind(args)
    state, residuals = self.binding.read()
    if diloco_layout.is_diloco(state) and not diloco_layout.is_stored(state):
      objs = tuple(a for a in args if is_graph_node(a))
      self.prepare(objs)   # the optimizer state's tree changes: walked again
      self.bindings.pop(tuple(id(a) for a in objs), None)
      self._bind(args)
      state, residuals = self.binding.read()
    b = self.binding
    if residuals is not None:
      state = self._remapped(with_residual_tree(state, residuals), self.inner)
    whole = [a for i, a in enumerate(args) if i not in b.positions and i != self.batch_at]
    return (state, args[self.batch_at], *whole)

  def __call__(self, args: tuple):
    state, batch, *whole = self.functional(args)
    b = self.binding
    new_state, metrics = self.inner(state, batch, *whole)
    new_residuals = residual_tree(new_state)
    b.write(new_state, new_residuals)
    if b.attach(new_state, new_residuals):   # the optimizer's graph changed: walked again
      self.binding = None
      self.bindings.pop(tuple(id(a) for a in args if is_graph_node(a)), None)
    return metrics


def objects(x) -> tuple | None:
  """The NNX objects a train loop or checkpoint was handed for its state (one object or a
  tuple/list of them, e.g. ``(model, optimizer)``), or None for a functional state."""
  items = tuple(x) if isinstance(x, (tuple, list)) else (x,)
  return items if items and all(is_graph_node(a) for a in items) else None


def snapshot(objs: tuple) -> tuple[NnxState, Binding]:
  """``objs``' values as the functional state a checkpoint saves (residuals included)."""
  binding = Binding.of(objs)
  state, residuals = binding.read()
  return (state if residuals is None else with_residual_tree(state, residuals)), binding


def restore_into(objs: tuple, binding: Binding, state: NnxState) -> tuple:
  """Writes a restored functional state back into ``objs`` (giving the optimizer residuals or a
  loss scale it did not hold yet); returns ``objs``."""
  residuals = residual_tree(state)
  binding.write(state, residuals)
  binding.attach(state, residuals)
  return objs


def step_count(objs: tuple) -> int:
  """The optimizer's step count (0 where the objects hold no optimizer)."""
  nnx = nnx_module()
  for o in objs:
    if isinstance(o, nnx.Optimizer):
      return int(jax.device_get(o.step.get_value()))
  return 0

