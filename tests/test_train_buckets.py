"""Gradient buckets: order of use, fusion, one reduction per bucket, issued inside backprop."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import jaxring.train as jt
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
