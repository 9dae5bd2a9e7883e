"""The LM recipe: a causal GPT, GPT-2 small's parameter count, the generated text's entropy, and
training through @jaxring.train_step with FSDP (equal to the replicated step, the loss falls)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxring._src.train.sharding import shard_dim
from recipes import lm, lm_data, train


def _small(**kw):
  """One 128-wide layer on 32-character windows: compiles and steps in seconds. (At a peak rate
  of 5e-3 and above it sat at the unigram entropy for 100 steps; 3e-3 learns.)"""
  base = dict(num_layers=1, width=128, num_heads=4, context=32, train_sequences=1024,
              val_sequences=32, batch_size=32, num_steps=100, warmup_steps=10,
              learning_rate=3e-3, log_every=25, progress=False, cpu_devices=0)
  return dataclasses.replace(lm.get_config("tiny_cpu"), **{**base, **kw})


def _params(model, context):
  return jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, context), jnp.int32))["params"]


@pytest.mark.parametrize("tied", [True, pytest.param(False, marks=pytest.mark.slow)])  # ~0.7 s
def test_a_later_token_never_changes_earlier_logits(tied):
  config = _small(tied=tied)
  model = lm.create_model(config)
  params = _params(model, config.context)
  tokens = np.random.default_rng(0).integers(0, 27, (2, config.context)).astype(np.int32)
  changed = tokens.copy()
  changed[:, 20] = (tokens[:, 20] + 5) % 27
  apply = jax.jit(model.apply)
  a = np.asarray(apply({"params": params}, tokens))
  b = np.asarray(apply({"params": params}, changed))
  assert a.shape == (2, config.context, config.vocab_size)
  np.testing.assert_array_equal(a[:, :20], b[:, :20])
  assert np.abs(a[:, 20:] - b[:, 20:]).max(axis=-1).min() > 1e-6  # every later position moves


def _gpt2_count(vocab, context, layers, d, tied):
  """GPT-2's parameters, leaf by leaf as in the paper's code (c_attn, c_proj, c_fc, ...)."""
  per_layer = (2 * d                     # ln_1 scale and bias
               + d * 3 * d + 3 * d       # c_attn: q, k, v
               + d * d + d               # attn c_proj
               + 2 * d                   # ln_2
               + d * 4 * d + 4 * d       # mlp c_fc
               + 4 * d * d + d)          # mlp c_proj
  return vocab * d + context * d + layers * per_layer + 2 * d + (0 if tied else vocab * d)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_small_has_gpt2s_parameter_count_and_every_large_leaf_splits_8_ways(tied):
  config = dataclasses.replace(lm.get_config("gpt2_small"), tied=tied)
  model = lm.create_model(config)
  shapes = jax.eval_shape(lambda: _params(model, config.context))
  leaves = jax.tree_util.tree_leaves(shapes)
  count = sum(int(np.prod(x.shape)) for x in leaves)
  assert count == _gpt2_count(50257, 1024, 12, 768, tied)
  assert count == (124_439_808 if tied else 124_439_808 + 50257 * 768)  # HF's gpt2, tied
  unsplit = [x.shape for x in leaves if shard_dim(x.shape, 8) is None]
  assert unsplit == []  # every leaf, the 768-wide LayerNorms and biases included


def test_markov_entropy_rate_matches_the_sampled_texts_log_likelihood():
  source = lm_data.MarkovText(seed=3)
  text = lm_data.MarkovText.decode(source.sample(200_000, np.random.default_rng(5)))
  index = {lm_data.MarkovText.decode(w): i for i, w in enumerate(source.lexicon)}
  words = [index[w] for w in text.split(" ")[1:-1]]  # whole words only
  p = source.transitions
  nll = -np.sum(np.log(p[words[:-1], words[1:]]))
  chars = sum(len(source.lexicon[w]) + 1 for w in words[1:])
  assert nll / chars == pytest.approx(source.entropy_rate(), rel=0.03)
  assert source.entropy_rate() < 0.1 * lm_data.unigram_entropy(np.frombuffer(
      text.encode(), np.uint8))


def test_sequences_are_deterministic_per_seed_and_splits_differ():
  a = lm_data.sequences("markov", "train", 16, 32, seed=1)
  np.testing.assert_array_equal(a, lm_data.sequences("markov", "train", 16, 32, seed=1))
  assert a.shape == (16, 33) and a.dtype == np.int32 and a.max() < lm_data.MARKOV_VOCAB
  assert not np.array_equal(a, lm_data.sequences("markov", "val", 16, 32, seed=1))
  assert not np.array_equal(a, lm_data.sequences("markov", "train", 16, 32, seed=2))
  source = lm_data.sequences("stdlib", "train", 64, 255)
  assert b"def " in bytes(source[:, :-1].astype(np.uint8).ravel())  # Python, one token per byte


def test_command_line_picks_a_config_and_overrides_it():
  c = lm.parse_args(["--config=gpt2_small", "--config.shard=params", "--num-steps", "5",
                     "--config.param_compression=int8", "--tied=false"])
  assert (c.width, c.shard, c.num_steps, c.param_compression, c.tied) == (768, "params", 5,
                                                                          "int8", False)
  with pytest.raises(ValueError, match="unknown config field"):
    lm.parse_args(["--widht=3"])
  with pytest.raises(ValueError, match="param_compression"):
    train.step_compression(dataclasses.replace(c, shard="none"))


def _run_steps(config, steps):
  tx, schedule = lm.make_optimizer(config)
  model = lm.create_model(config)
  state = lm.create_train_state(config, model, tx)
  step = lm.make_train_step(config, schedule)
  batches = lm_data.batches(lm_data.sequences("markov", "train", 256, config.context),
                            config.batch_size)
  with jax.numpy_dtype_promotion("standard"):
    for _ in range(steps):
      state, metrics = step(state, next(batches))
  return state, metrics


@pytest.mark.slow   # two LM train steps side by side (~4 s)
@pytest.mark.timeout(600)  # ~20 s of CPU; 111-191 s of wall time at load 35-45 on 2 cores
def test_fsdp_equals_the_replicated_step_on_the_lm():
  config = _small(num_steps=20)
  want, m_want = _run_steps(config, 3)
  got, m_got = _run_steps(dataclasses.replace(config, shard="params"), 3)
  assert "data" in str(got.params["block0"]["attn"]["qkv"]["kernel"].sharding.spec)
  assert float(m_got["loss"]) == pytest.approx(float(m_want["loss"]), rel=1e-5)
  d = config.width
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want.params),
                          jax.tree_util.tree_leaves(got.params)):
    a, b, name = np.asarray(a), np.asarray(b), jax.tree_util.keystr(path)
    if name.endswith("['qkv']['bias']"):
      # the key bias adds q.b to every score of a query, which softmax ignores: its gradient is
      # zero in exact arithmetic, and Adam turns rounding noise into steps of up to the learning
      # rate, differently for any other order of summation. Bounded, not compared.
      assert np.abs(b[d:2 * d] - a[d:2 * d]).max() <= 3 * config.learning_rate
      a, b = np.delete(a, np.s_[d:2 * d]), np.delete(b, np.s_[d:2 * d])
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow   # trains the small LM (~3 s)
def test_small_lm_trains_fully_sharded_below_the_unigram_entropy():
  summary = lm.train_and_evaluate(_small(shard="params"))
  losses = summary["losses"]
  assert len(losses) == 100
  assert np.mean(losses[-10:]) < 0.6 * summary["unigram_entropy"] < np.mean(losses[:3])
  assert summary["final"]["eval_loss"] < 0.6 * summary["unigram_entropy"], summary["final"]
  assert summary["final"]["eval_perplexity"] == pytest.approx(
      np.exp(summary["final"]["eval_loss"]))
  assert summary["entropy_floor"] < summary["final"]["eval_loss"]


# The 2% goal of int8 weights + gradients against uncompressed FSDP on tiny_cpu (two 200-step
# runs) is a benchmark's: `python -m recipes.bench_lm` (docs/benchmarks.md, "LM recipe").
