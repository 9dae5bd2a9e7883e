"""A GPT-style decoder-only language model, trained through ``@jaxring.train_step`` with FSDP.

The model is GPT-2's (Radford et al. 2019): learned token and position embeddings, pre-LayerNorm
blocks of causal multi-head self-attention and a 4x GELU MLP, a final LayerNorm, and a head tied to
the token embedding (``tied=False``: a separate bias-free one). Weights start N(0, 0.02), the two
projections back into the residual stream N(0, 0.02 / sqrt(2 * layers)).

Configs (``--config=<name>``): ``tiny_cpu`` (~1.8M parameters, characters of a generated Markov
text, 8 emulated CPU devices) and ``gpt2_small`` (124,439,808 parameters: 12 layers, 768 wide, 12
heads, 1024 context, GPT-2's 50,257-token vocabulary; for GPUs, on the byte-level stdlib text:
the embedding rows past 256 are never used). Every width is a multiple of 8, so with
``--config.shard=params`` every large leaf is split over 8 replicas (the embedding along its 768).

AdamW with decay on the 2-D weights only, after clipping the gradient's global norm to
``grad_clip`` (1.0, as GPT-2 reproductions train; with ``shard=params`` the norm is summed over the
replicas' blocks: jaxring._src.train.global_view), linear warm-up then cosine decay; the loss is the mean next-token cross entropy, and evaluation reports
it with its perplexity on held-out text.

Launch:

  python -m recipes.lm --config=tiny_cpu                             # replicated, uncompressed
  python -m recipes.lm --config=tiny_cpu --config.shard=params       # FSDP
  python -m recipes.lm --config=tiny_cpu --config.shard=params --config.algorithm=ring \
      --config.compression=int8 --config.param_compression=int8     # int8 weights and gradients
  python -m recipes.lm --config=tiny_cpu --config.api=nnx            # the GPT in NNX: lm_nnx.py
  python -m recipes.lm --config=tiny_cpu --config.diloco_every=50 \
      --config.diloco_compression=int8                               # DiLoCo, 2 nodes x 4
  jaxring train lm --config=gpt2_small --config.batch_size=64        # on GPUs
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxring
import jaxring.train as jt
from recipes import lm_data, optim, train
from recipes.config import override


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """One LM run. The reduction and bookkeeping fields are spelled as in :class:`recipes.config.Config`."""

  # model
  num_layers: int = 4
  width: int = 192
  num_heads: int = 4
  context: int = 64
  vocab_size: int = 32
  tied: bool = True
  dtype: str = "float32"             # compute dtype; parameters stay f32
  # data
  dataset: str = "markov"            # "markov" (generated) or "stdlib" (Python's own sources)
  train_sequences: int = 8192
  val_sequences: int = 256
  # optimization
  batch_size: int = 32               # global, over all processes
  num_steps: int = 200
  learning_rate: float = 3e-3        # peak
  warmup_steps: int = 20
  weight_decay: float = 0.1
  grad_clip: float = 1.0             # global gradient norm; 0: no clipping
  # reduction, as recipes.config.Config
  compression: str = "none"
  algorithm: str = "auto"
  mesh: str = "flat"
  bucket_mib: float = 25.0
  shard: str = "none"
  param_compression: str = "none"
  hpz: bool = False
  error_feedback: bool = True
  # DiLoCo: the devices as diloco_nodes nodes, synced every diloco_every steps (0: every step)
  diloco_every: int = 0
  diloco_nodes: int = 2
  diloco_compression: str = "none"   # the pseudo-gradients' codec
  diloco_outer_lr: float = 0.7       # the outer SGD with Nesterov momentum (DiLoCo's)
  diloco_outer_momentum: float = 0.9
  diloco_warmup: int = 0             # synchronous steps first
  # bookkeeping
  workdir: str = ""
  seed: int = 0
  log_every: int = 25
  eval_every: int = 0                # steps; 0: at the end only
  checkpoint_every: int = 1000
  progress: bool = True
  cpu_devices: int = 0
  api: str = "linen"                 # "linen" (this module's GPT) or "nnx" (recipes.lm_nnx)


CONFIGS = {
    "tiny_cpu": LMConfig(cpu_devices=8),
    "gpt2_small": LMConfig(num_layers=12, width=768, num_heads=12, context=1024,
                           vocab_size=50257, dtype="bfloat16", dataset="stdlib",
                           train_sequences=560, val_sequences=64, batch_size=64, num_steps=500,
                           learning_rate=6e-4, warmup_steps=50, log_every=10, eval_every=100),
}


def get_config(name: str = "tiny_cpu") -> LMConfig:
  if name not in CONFIGS:
    raise ValueError(f"unknown LM config {name!r}; configs: {', '.join(CONFIGS)}")
  return CONFIGS[name]


# --- the model ----------------------------------------------------------------------------------


def layer_norm(x, name: str, dtype):
  """LayerNorm computed in f32 whatever the compute dtype (bf16 statistics lose the mean)."""
  return nn.LayerNorm(name=name)(x.astype(jnp.float32)).astype(dtype)


class CausalSelfAttention(nn.Module):
  num_heads: int
  out_init: Any
  dtype: Any

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    qkv = nn.Dense(3 * d, dtype=self.dtype, kernel_init=nn.initializers.normal(0.02),
                   name="qkv")(x)
    q, k, v = (z.reshape(b, t, self.num_heads, d // self.num_heads)
               for z in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(d //
                                                                                self.num_heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(self.dtype)
    y = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
    return nn.Dense(d, dtype=self.dtype, kernel_init=self.out_init, name="proj")(y)


class Block(nn.Module):
  """Pre-LayerNorm: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

  num_heads: int
  out_init: Any
  dtype: Any

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    x = x + CausalSelfAttention(self.num_heads, self.out_init, self.dtype, name="attn")(
        layer_norm(x, "ln1", self.dtype))
    y = layer_norm(x, "ln2", self.dtype)
    y = nn.gelu(nn.Dense(4 * d, dtype=self.dtype, kernel_init=nn.initializers.normal(0.02),
                         name="fc")(y))
    return x + nn.Dense(d, dtype=self.dtype, kernel_init=self.out_init, name="fc_proj")(y)


class GPT(nn.Module):
  """``tokens int [batch, time] -> logits f32 [batch, time, vocab_size]``, causal."""

  vocab_size: int
  context: int
  num_layers: int
  width: int
  num_heads: int
  tied: bool = True
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens):
    if tokens.shape[1] > self.context:
      raise ValueError(f"sequence of {tokens.shape[1]} tokens, context is {self.context}")
    embed = nn.Embed(self.vocab_size, self.width, embedding_init=nn.initializers.normal(0.02),
                     name="wte")
    positions = self.param("wpe", nn.initializers.normal(0.01), (self.context, self.width))
    x = (embed(tokens) + positions[:tokens.shape[1]]).astype(self.dtype)
    out_init = nn.initializers.normal(0.02 / math.sqrt(2 * self.num_layers))
    for i in range(self.num_layers):
      x = Block(self.num_heads, out_init, self.dtype, name=f"block{i}")(x)
    x = layer_norm(x, "ln_f", self.dtype)
    if self.tied:
      return embed.attend(x.astype(jnp.float32))
    return nn.Dense(self.vocab_size, use_bias=False, kernel_init=nn.initializers.normal(0.02),
                    name="head")(x.astype(jnp.float32))


def create_model(config: LMConfig) -> GPT:
  if config.width % config.num_heads:
    raise ValueError(f"width {config.width} is not a multiple of num_heads {config.num_heads}")
  return GPT(config.vocab_size, config.context, config.num_layers, config.width,
             config.num_heads, config.tied, train.DTYPES[config.dtype])


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Mean cross entropy of ``logits[:, i]`` predicting ``tokens[:, i + 1]``."""
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))


# --- training -----------------------------------------------------------------------------------


def make_optimizer(config: LMConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW (b2 0.95) on the schedule of :func:`recipes.optim.learning_rate_schedule`, after
  clipping the gradient's global norm to ``grad_clip``; weight decay on the matrices
  (embeddings, kernels), not on LayerNorm scales or biases."""
  schedule = optim.learning_rate_schedule(config.learning_rate, config.num_steps,
                                          config.warmup_steps)
  decay = lambda params: jax.tree_util.tree_map(lambda p: np.ndim(p) >= 2, params)  # noqa: E731
  adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay, mask=decay)
  if config.grad_clip > 0:
    adamw = optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
  if config.diloco_every:
    outer = optax.sgd(config.diloco_outer_lr, momentum=config.diloco_outer_momentum or None,
                      nesterov=config.diloco_outer_momentum > 0)
    adamw = jaxring.diloco(adamw, axis="node", every=config.diloco_every, outer=outer,
                           warmup_steps=config.diloco_warmup,
                           compression=jaxring.codecs.parse(config.diloco_compression))
  return adamw, schedule


def lm_mesh(config: LMConfig):
  """The mesh: the step's default, or with DiLoCo the devices as ``(diloco_nodes, rest)``."""
  if not config.diloco_every:
    return jt.default_mesh(train.axis_name(config))
  devices = np.asarray(jax.devices())
  if devices.size % config.diloco_nodes:
    raise ValueError(f"diloco_nodes={config.diloco_nodes} must divide the {devices.size} devices")
  return jax.sharding.Mesh(devices.reshape(config.diloco_nodes, -1), ("node", "local"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)


def create_train_state(config: LMConfig, model: GPT, tx) -> jt.TrainState:
  def create(key):
    params = model.init(key, jnp.zeros((1, config.context), jnp.int32))["params"]
    return jt.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  return jax.jit(create)(jax.random.key(config.seed, impl="rbg"))


def train_step_decorator(config: LMConfig, mesh=None) -> Callable:
  """``@jaxring.train_step`` with the config's reduction, for the Linen and the NNX step."""
  axis = ("node", "local") if config.diloco_every else train.axis_name(config)
  return jt.train_step(mesh if mesh is not None else lm_mesh(config), axis_name=axis,
                       algorithm=config.algorithm, compression=train.step_compression(config),
                       error_feedback=config.error_feedback,
                       bucket_bytes=int(config.bucket_mib * (1 << 20)), shard=config.shard,
                       hpz=config.hpz, grad_axes="local" if config.diloco_every else None)


def make_train_step(config: LMConfig, schedule: optax.Schedule, mesh=None) -> jt.TrainStep:
  """The single-device LM step under ``@jaxring.train_step`` with the config's reduction."""
  def step(state, batch):
    tokens = batch["tokens"]

    def loss_fn(params):
      return next_token_loss(state.apply_fn({"params": params}, tokens[:, :-1]), tokens)

    loss, grads = jaxring.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss,
                                                "learning_rate": schedule(state.step)}

  return train_step_decorator(config, mesh)(step)


def make_evaluate(config: LMConfig, model: GPT, tokens: np.ndarray):
  """``state -> {eval_loss, eval_perplexity, eval_tokens}`` over ``tokens`` (held out), read from
  the state's arrays whatever their sharding (XLA gathers split parameters)."""
  per_batch = max(config.batch_size, 1)

  @jax.jit
  def summed(params, chunk):
    logits = model.apply({"params": params}, chunk[:, :-1])
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, chunk[:, 1:]))

  def evaluate(state) -> dict:
    total = 0.0
    for i in range(0, tokens.shape[0], per_batch):
      total += float(summed(state.params, tokens[i:i + per_batch]))
    n = tokens.shape[0] * (tokens.shape[1] - 1)
    return {"eval_loss": total / n, "eval_perplexity": math.exp(total / n), "eval_tokens": n}
  return evaluate


def train_and_evaluate(config: LMConfig) -> dict[str, Any]:
  """Trains ``config`` for ``num_steps`` through :func:`jaxring.train.fit` and evaluates it.

  Returns:
    ``steps``, ``final`` (eval loss and perplexity), ``losses`` (training loss at every logged
    step), ``params``, ``entropy_floor`` and ``unigram_entropy`` (nats/token), ``tokens_per_s``,
    ``compile_s``, ``devices``, ``state`` (``api="nnx"``: the objects ``(model, optimizer)``,
    trained in place) and ``step_fn``.

  Example:
    >>> summary = train_and_evaluate(get_config("tiny_cpu"))
    >>> summary["final"]["eval_loss"] < 0.5 * summary["unigram_entropy"]
    True
  """
  mesh = lm_mesh(config)
  if config.batch_size % mesh.size:
    raise ValueError(f"batch_size {config.batch_size} must be a multiple of the {mesh.size} "
                     "devices")
  tokens = lm_data.sequences(config.dataset, "train", config.train_sequences, config.context,
                             config.seed)
  val = lm_data.sequences(config.dataset, "val", config.val_sequences, config.context,
                          config.seed)
  if tokens.max() >= config.vocab_size:
    raise ValueError(f"the {config.dataset} text has token {tokens.max()}, vocab_size is "
                     f"{config.vocab_size}")
  tx, schedule = make_optimizer(config)
  if config.api == "nnx":     # the state is the objects (model, optimizer), stepped in place
    from recipes import lm_nnx
    state = lm_nnx.create_objects(config, tx)
    step = lm_nnx.make_train_step(config, schedule, mesh)
    evaluate = lm_nnx.make_evaluate(config, val)
    params = lm_nnx.param_count(state[0])
  elif config.api == "linen":
    model = create_model(config)
    step = make_train_step(config, schedule, mesh)
    state = create_train_state(config, model, tx)
    evaluate = make_evaluate(config, model, val)
    params = sum(int(np.size(p)) for p in jax.tree_util.tree_leaves(state.params))
  else:
    raise ValueError(f"--config.api must be 'linen' or 'nnx', got {config.api!r}")
  ckpt = jt.Checkpointer(os.path.join(config.workdir, "checkpoints")) if config.workdir else None
  metrics_path = os.path.join(config.workdir, "metrics.jsonl") if config.workdir else None
  fitted = jt.FitSummary()
  losses = _LossLog()
  try:
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction: float ** int32
      state = jt.fit(losses.wrap(step), state, lm_data.batches(tokens, config.batch_size,
                                                               config.seed),
                     num_steps=config.num_steps, checkpointer=ckpt,
                     checkpoint_every=config.checkpoint_every, log_every=config.log_every,
                     metrics_path=metrics_path, progress=config.progress, evaluate=evaluate,
                     eval_every=config.eval_every, steady_state=True, summary=fitted)
  finally:
    if ckpt is not None:
      ckpt.close()
  rate = fitted.images_per_s
  return {"steps": config.num_steps, "start_step": fitted.start_step, "final": fitted.last_eval,
          "losses": losses.read(), "devices": mesh.size, "state": state, "step_fn": step,
          "params": params,
          "entropy_floor": lm_data.entropy_floor(config.dataset, config.seed),
          "unigram_entropy": lm_data.unigram_entropy(tokens),
          "tokens_per_s": None if rate is None else rate * config.context,
          "compile_s": fitted.compile_s, "config": dataclasses.asdict(config)}


class _LossLog:
  """Keeps every step's loss (as device arrays, read once at the end: no host sync per step)."""

  def __init__(self):
    self._losses = []

  def wrap(self, step):
    def logged(*args):   # (state, batch) -> (state, metrics); NNX: (*objects, batch) -> metrics
      out = step(*args)
      self._losses.append((out if isinstance(out, dict) else out[1])["loss"])
      return out
    logged.prepare = step.prepare
    return logged

  def read(self) -> list[float]:
    return [float(np.mean(x)) for x in jax.device_get(self._losses)]   # DiLoCo: per node


# --- command line -------------------------------------------------------------------------------


def parse_args(argv) -> LMConfig:
  """``--config=<name>`` picks the config (default ``tiny_cpu``); the rest override its fields."""
  name, rest = "tiny_cpu", []
  for arg in argv:
    if arg.startswith("--config="):
      name = arg.split("=", 1)[1]
    else:
      rest.append(arg)
  return override(get_config(name), rest)


def main(argv=None) -> int:
  import jaxring.distributed

  argv = sys.argv[1:] if argv is None else list(argv)
  if "-h" in argv or "--help" in argv:
    print(f"--config={{{','.join(CONFIGS)}}}, then --config.name=value or --name value:")
    for name, value in dataclasses.asdict(get_config()).items():
      print(f"  --{name.replace('_', '-')} {value!r}")
    return 0
  config = parse_args(argv)
  jaxring.distributed.initialize(local_device_count=config.cpu_devices or None)
  summary = train_and_evaluate(config)
  if jax.process_index() == 0:
    final = summary["final"]
    print(f"GPT{' (NNX)' if config.api == 'nnx' else ''} ({summary['params']:,} params, "
          f"{config.num_layers}x{config.width}) on "
          f"{summary['devices']} devices, shard={config.shard}, compression "
          f"{config.compression}/{config.param_compression}, {summary['steps']} steps: eval loss "
          f"{final['eval_loss']:.4f} nats/token, perplexity {final['eval_perplexity']:.3f} "
          f"(unigram {summary['unigram_entropy']:.3f}, floor {summary['entropy_floor']:.3f})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
