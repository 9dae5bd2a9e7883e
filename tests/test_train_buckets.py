"""Gradient buckets: order of use, fusion, one reduction per bucket, issued inside backprop."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import jaxring.train as jt
from jaxring._src.train import buckets as jt_buckets
from jaxring._src.train.buckets import make_buckets, use_order

WIDTHS = (16, 32, 48, 64, 10)  # distinct sizes: every layer's buffers can be told apart in HLO


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for w in WIDTHS[1:-1]:
      x = jnp.tanh(nn.Dense(w)(x))
    return nn.Dense(WIDTHS[-1])(x)


def test_use_order_follows_the_forward_pass_not_the_dict_keys():
  params = {"a_last": jnp.ones((3, 3)), "b_first": jnp.ones((3, 3)), "c_middle": jnp.ones(3)}

  def f(leaves):
    p = jax.tree.unflatten(jax.tree.structure(params), leaves)
    h = jnp.ones(3) @ p["b_first"].astype(jnp.bfloat16).astype(jnp.float32)  # casts: not a use
    h = jnp.sin(h + p["c_middle"])
    return jnp.sum(h @ p["a_last"])

  order = use_order(lambda *ls: f(list(ls)), jax.tree.leaves(params))
  assert order == [1, 2, 0]  # flatten order is a_last, b_first, c_middle


def test_buckets_fuse_small_tensors_in_backward_order():
  leaves = [jnp.ones(100), jnp.ones(4), jnp.ones(100), jnp.ones(4), jnp.ones(2, jnp.bfloat16)]
  # forward order 0..4: gradients complete as 4, 3, 2, 1, 0; each dtype fills its own buckets,
  # which close at >= 400 bytes; a bucket is reduced once its last gradient exists (bf16 first)
  buckets = make_buckets(leaves, [0, 1, 2, 3, 4], bucket_bytes=400)
  assert [b.indices for b in buckets] == [(4,), (3, 2), (1, 0)]
  assert [b.numel for b in buckets] == [2, 104, 104]
  assert buckets[0].dtype == jnp.bfloat16


def _bucket_numels():
  """By hand: kernel + bias per layer; at 4 KiB, the last two layers share a bucket."""
  sizes = [i * o + o for i, o in zip(WIDTHS[:-1], WIDTHS[1:])]  # 544, 1584, 3136, 650
  return [sizes[3] + sizes[2], sizes[1], sizes[0]]


def _compiled_hlo(overlap):
  model = MLP()
  x = np.ones((64, WIDTHS[0]), np.float32)
  y = np.zeros(64, np.int32)
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  state = jt.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

  @jt.train_step(bucket_bytes=4096, overlap=overlap, algorithm="xla")
  def step(state, batch):
    def loss_fn(p):
      logits = state.apply_fn({"params": p}, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    loss, grads = jt.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  text = step.lower(state, {"x": x, "y": y}).compile().as_text()
  return text[text.index("\nENTRY"):].splitlines()


def _bucket_all_reduces(lines, numels):
  """Line index of the all-reduce carrying each bucket (its buffer: the bucket + a token)."""
  found = {}
  for k, line in enumerate(lines):
    if " all-reduce(" not in line:
      continue
    for n in map(int, re.findall(r"f32\[(\d+)\]", line.split(" all-reduce(")[0])):
      for b, numel in enumerate(numels):
        if numel <= n <= numel + 1:
          assert b not in found, f"bucket {b} reduced twice"
          found[b] = k
  return found


def _first_layer_kernel_grad(lines):
  shape = rf"f32\[{WIDTHS[0]},{WIDTHS[1]}\]"
  hits = [k for k, l in enumerate(lines)
          if re.search(rf"= {shape}\{{[^}}]*\}} (dot|fusion)\(", l) and "transpose(" in l]
  assert hits, "no backward-pass dot for the first layer's kernel"
  return hits[0]


@pytest.mark.slow   # compiles whole train steps (~3-5 s each)
@pytest.mark.parametrize("overlap", [True, False])
def test_one_reduction_per_bucket_scheduled_inside_backprop(overlap):
  lines = _compiled_hlo(overlap)
  numels = _bucket_numels()
  found = _bucket_all_reduces(lines, numels)
  assert sorted(found) == [0, 1, 2], found
  n_all_reduce = sum(" all-reduce(" in l for l in lines)
  assert n_all_reduce == 3  # the loss's pmean rides along with one of them (XLA combines it)
  last_backprop_op = _first_layer_kernel_grad(lines)
  if overlap:
    # the first bucket (last layers) is on the wire before backprop reaches the first layer
    assert found[0] < last_backprop_op
    assert found[0] < found[1] < found[2]
  else:
    assert min(found.values()) > last_backprop_op


# --- bucket_bytes="auto": the profile's costs, bucketed as make_buckets does, timed by hand ------

MiB = 1 << 20


def _profile(axes, sizes, lines):
  from jaxring._src import profiles
  from jaxring._src.algorithms import planner
  groups = planner.levels_for(tuple(axes), tuple(sizes))[0]
  key = planner.codec_key([planner.codec_for(None, g.name, jnp.float32) for g in groups])
  fits = tuple(profiles.Fit.from_points(a, key, *zip(*pts)) for a, pts in lines.items())
  return profiles.Profile(profiles.profile_key(axes, sizes, "xla", 1, "cpu"), fits)


# xla: 20 ms at 1 MiB, 0.6 s at 32 MiB; hierarchical: cheaper small, dearer large
LINES = {"xla": [(64 << 10, 0.005), (MiB, 0.02), (32 * MiB, 0.6)],
         "hierarchical": [(64 << 10, 0.004), (MiB, 0.01), (32 * MiB, 0.7)]}
LEAVES = [jax.ShapeDtypeStruct((MiB // 4,), jnp.float32)] * 32      # 32 x 1 MiB


def test_auto_bucket_bytes_without_a_profile_is_the_default():
  choice = jt_buckets.auto_bucket_bytes(LEAVES, range(32), "data", axis_sizes=(8,), profile=None)
  assert choice == jt_buckets.BucketChoice(25 << 20) and not choice.measured


def test_auto_bucket_bytes_chooses_size_and_algorithm_together():
  prof = _profile(("node", "local"), (4, 2), LINES)
  choice = jt_buckets.auto_bucket_bytes(LEAVES, range(32), ("node", "local"), axis_sizes=(4, 2),
                                        backward_seconds=1.0, profile=prof)
  # 1 MiB buckets: one per leaf, ready every 1/32 s; hierarchical (10 ms, half of xla's) is done
  # before the next is ready, so only the last one's 10 ms shows after backprop
  assert choice.bucket_bytes == MiB and choice.measured
  assert choice.algorithms == ("hierarchical",) * 32
  assert choice.finish_s == pytest.approx(1.01) and choice.exposed_s == pytest.approx(0.01)
  # 25 MiB (by hand): 25 leaves ready at 25/32 s, xla 0.02 + 0.58 * 24/31 = 0.4690 s (hierarchical
  # 0.5442); then 7 MiB, xla 0.1323 (hierarchical 0.1435): ends 0.78125 + 0.4690 + 0.1323
  fixed = jt_buckets.auto_bucket_bytes(LEAVES, range(32), ("node", "local"), axis_sizes=(4, 2),
                                       backward_seconds=1.0, profile=prof,
                                       candidates=(25 << 20,))
  assert fixed.algorithms == ("xla", "xla")
  assert fixed.finish_s == pytest.approx(0.78125 + 0.02 + 0.58 * 24 / 31 + 0.02 + 0.58 * 6 / 31)


def test_auto_bucket_bytes_margin_is_on_the_reductions_not_the_step():
  prof = _profile(("node", "local"), (4, 2), LINES)
  choice = jt_buckets.auto_bucket_bytes(LEAVES, range(32), ("node", "local"), axis_sizes=(4, 2),
                                        backward_seconds=10.0, profile=prof)
  # 25 MiB: the first bucket ends before backprop does, the last 7 MiB (xla, 0.1323 s) starts at
  # 10 s; 1 MiB buckets leave 10 ms. The gain (1.2% of the step) is 20% of the default's
  # reductions (0.469 + 0.132 s), above the planner's margin
  assert choice.bucket_bytes == MiB
  assert choice.finish_s == pytest.approx(10.01)
  assert choice.exposed_s == pytest.approx(0.01)


def test_auto_bucket_bytes_keeps_the_default_within_the_margin():
  # one bucket holds everything at 16 MiB and above; no overlap credited: 16 MiB ties 25 MiB
  prof = _profile(("data",), (8,), {"xla": [(MiB, 0.01 + 1e-9 * MiB), (32 * MiB, 0.01 + 32e-9 * MiB)]})
  leaves = [jax.ShapeDtypeStruct((64 << 10,), jnp.float32)] * 64      # 64 x 256 KiB
  choice = jt_buckets.auto_bucket_bytes(leaves, range(64), "data", axis_sizes=(8,), profile=prof)
  assert choice.bucket_bytes == 25 << 20 and choice.algorithms == ("xla",)
  assert choice.finish_s == pytest.approx(0.01 + 16e-9 * MiB)


def test_auto_bucket_bytes_reads_the_bound_axes_and_the_profile_auto_reads():
  from jaxring._src import profiles
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  # one level: the ring is the lossless alternative to the native all-reduce
  prof = _profile(("data",), (8,), {"xla": LINES["xla"], "ring": LINES["hierarchical"]})
  got = []

  def trace():   # a new function each time: nothing cached between the traces
    def body(x):
      got.append(jt_buckets.auto_bucket_bytes(LEAVES, range(32), "data", backward_seconds=1.0))
      return x
    jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=jax.P("data"),
                                 out_specs=jax.P("data")))(jnp.zeros(8))

  with profiles.use_profile(prof):
    trace()
  assert got[0].bucket_bytes == MiB and got[0].algorithms == ("ring",) * 32
  with profiles.use_profile(None):
    trace()
  assert got[1] == jt_buckets.BucketChoice(25 << 20)
