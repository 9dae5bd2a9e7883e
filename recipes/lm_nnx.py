"""The LM recipe's GPT in Flax NNX, trained as ``step(model, optimizer, batch)`` through
``@jaxring.train_step`` (``python -m recipes.lm --config.api=nnx``).

The model is :class:`recipes.lm.GPT` written as ``nnx.Module`` objects: the same layers, the same
initializers (N(0, 0.02), N(0, 0.01) for the positions, N(0, 0.02 / sqrt(2 * layers)) for the two
projections into the residual stream), LayerNorm in f32 whatever the compute dtype, and the same
parameter paths, so ``nnx.to_pure_dict(nnx.state(model, nnx.Param))`` has the Linen model's
``params`` tree (``block0/attn/qkv/kernel``, ``wte/embedding``, ``wpe``, ...) and either loads
the other's weights. The Linen GPT has no dropout; neither has this one.

Training is the Linen recipe's (:func:`recipes.lm.train_and_evaluate`: the data, AdamW and its
schedule, ``jaxring.train.fit``, checkpoints), with the objects ``(model, optimizer)`` in place of
the ``TrainState`` and the step updating them in place; the reduction is the config's
(:func:`recipes.lm.train_step_decorator`). Evaluation runs the model under ``nnx.jit``.

Launch:

  python -m recipes.lm --config=tiny_cpu --config.api=nnx
  python -m recipes.lm --config=tiny_cpu --config.api=nnx --config.shard=params \
      --config.compression=int8
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxring
import jaxring.train as jt
from recipes import lm, train


class LayerNorm(nnx.LayerNorm):
  """``nnx.LayerNorm`` computed in f32 whatever the compute dtype (bf16 statistics lose the
  mean), the result cast back: :func:`recipes.lm.layer_norm` (its ``scale`` and ``bias`` where
  the Linen one has them)."""

  def __init__(self, width: int, dtype: Any, *, rngs: nnx.Rngs):
    super().__init__(width, rngs=rngs)
    self.compute_dtype = dtype

  def __call__(self, x):
    return super().__call__(x.astype(jnp.float32)).astype(self.compute_dtype)


class CausalSelfAttention(nnx.Module):
  def __init__(self, width: int, num_heads: int, out_init, dtype, *, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.qkv = nnx.Linear(width, 3 * width, dtype=dtype,
                          kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.proj = nnx.Linear(width, width, dtype=dtype, kernel_init=out_init, rngs=rngs)

  def __call__(self, x):
    b, t, d = x.shape
    h = self.num_heads
    q, k, v = (z.reshape(b, t, h, d // h) for z in jnp.split(self.qkv(x), 3, axis=-1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(d // h)
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(x.dtype)
    return self.proj(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d))


class Block(nnx.Module):
  """Pre-LayerNorm: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` with a 4x GELU MLP."""

  def __init__(self, width: int, num_heads: int, out_init, dtype, *, rngs: nnx.Rngs):
    self.ln1 = LayerNorm(width, dtype, rngs=rngs)
    self.attn = CausalSelfAttention(width, num_heads, out_init, dtype, rngs=rngs)
    self.ln2 = LayerNorm(width, dtype, rngs=rngs)
    self.fc = nnx.Linear(width, 4 * width, dtype=dtype,
                         kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.fc_proj = nnx.Linear(4 * width, width, dtype=dtype, kernel_init=out_init, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.fc_proj(nnx.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
  """``tokens int [batch, time] -> logits f32 [batch, time, vocab_size]``, causal; blocks are
  the attributes ``block0``, ``block1``, ... (the Linen model's names).

  Example:
    >>> model = GPT(32, 64, num_layers=2, width=64, num_heads=4, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((1, 64), jnp.int32)).shape
    (1, 64, 32)
  """

  def __init__(self, vocab_size: int, context: int, num_layers: int, width: int,
               num_heads: int, tied: bool = True, dtype: Any = jnp.float32, *,
               rngs: nnx.Rngs):
    self.context, self.num_layers, self.tied, self.dtype = context, num_layers, tied, dtype
    self.wte = nnx.Embed(vocab_size, width, embedding_init=nnx.initializers.normal(0.02),
                         rngs=rngs)
    self.wpe = nnx.Param(nnx.initializers.normal(0.01)(rngs.params(), (context, width)))
    out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * num_layers))
    for i in range(num_layers):
      setattr(self, f"block{i}", Block(width, num_heads, out_init, dtype, rngs=rngs))
    self.ln_f = LayerNorm(width, dtype, rngs=rngs)
    self.head = None if tied else nnx.Linear(width, vocab_size, use_bias=False,
                                             kernel_init=nnx.initializers.normal(0.02),
                                             rngs=rngs)

  def __call__(self, tokens):
    t = tokens.shape[1]
    if t > self.context:
      raise ValueError(f"sequence of {t} tokens, context is {self.context}")
    x = (self.wte(tokens) + self.wpe[:t]).astype(self.dtype)
    for i in range(self.num_layers):
      x = getattr(self, f"block{i}")(x)
    x = self.ln_f(x).astype(jnp.float32)
    return self.wte.attend(x) if self.tied else self.head(x)


def create_model(config: lm.LMConfig) -> GPT:
  """The config's GPT, initialized by one compiled function (``nnx.jit`` of the constructor, an
  ``rbg`` key: as :func:`recipes.lm.create_train_state`)."""
  if config.width % config.num_heads:
    raise ValueError(f"width {config.width} is not a multiple of num_heads {config.num_heads}")

  @nnx.jit
  def create():
    return GPT(config.vocab_size, config.context, config.num_layers, config.width,
               config.num_heads, config.tied, train.DTYPES[config.dtype],
               rngs=nnx.Rngs(jax.random.key(config.seed, impl="rbg")))
  return create()


def create_objects(config: lm.LMConfig, tx: optax.GradientTransformation) -> tuple:
  """``(model, optimizer)``: the GPT and its ``nnx.Optimizer`` over its ``nnx.Param``."""
  model = create_model(config)
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def param_count(model: nnx.Module) -> int:
  return sum(int(np.size(p)) for p in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))


def train_step_fn(schedule: optax.Schedule,
                  value_and_grad: Callable = jaxring.value_and_grad) -> Callable:
  """The single-device NNX step ``(model, optimizer, batch) -> metrics``, in place.

  ``value_and_grad`` is ``jaxring.value_and_grad`` under ``@jaxring.train_step`` (the gradients
  come back averaged over the replicas) and ``nnx.value_and_grad`` for a one-device reference.
  """
  def step(model, optimizer, batch):
    tokens = batch["tokens"]

    def loss_fn(model):
      return lm.next_token_loss(model(tokens[:, :-1]), tokens)

    loss, grads = value_and_grad(loss_fn)(model)
    learning_rate = schedule(optimizer.step[...])
    optimizer.update(model, grads)
    return {"loss": loss, "learning_rate": learning_rate}
  return step


def make_train_step(config: lm.LMConfig, schedule: optax.Schedule, mesh=None) -> jt.TrainStep:
  """The NNX step under ``@jaxring.train_step`` with the config's reduction."""
  return lm.train_step_decorator(config, mesh)(train_step_fn(schedule))


def make_evaluate(config: lm.LMConfig, tokens: np.ndarray):
  """``(model, optimizer) -> {eval_loss, eval_perplexity, eval_tokens}`` over ``tokens``
  (held out): the model under ``nnx.jit``, whatever its arrays' sharding."""
  per_batch = max(config.batch_size, 1)

  @nnx.jit
  def summed(model, chunk):
    logits = model(chunk[:, :-1])
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, chunk[:, 1:]))

  def evaluate(objects) -> dict:
    model = objects[0]
    total = 0.0
    for i in range(0, tokens.shape[0], per_batch):
      total += float(summed(model, tokens[i:i + per_batch]))
    n = tokens.shape[0] * (tokens.shape[1] - 1)
    return {"eval_loss": total / n, "eval_perplexity": math.exp(total / n), "eval_tokens": n}
  return evaluate
