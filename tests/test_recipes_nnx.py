"""The recipes in Flax NNX and the examples: the NNX GPT and ResNet are the Linen ones (the Linen
weights loaded, the same logits and BatchNorm statistics; the same initial distributions), the
NNX LM step through @jaxring.train_step equals the one-device ``nnx.jit`` step and the recipe
trains, ``jaxring demo --api nnx`` reports, and each example script's loss falls."""
import dataclasses
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import multiproc
import numpy as np
import pytest
from flax import nnx

from recipes import lm, lm_data, lm_nnx, models, models_nnx


def _small(**kw):
  """tests/test_lm_recipe.py's one 128-wide layer on 32-character windows, in NNX."""
  base = dict(num_layers=1, width=128, num_heads=4, context=32, train_sequences=1024,
              val_sequences=32, batch_size=32, num_steps=100, warmup_steps=10,
              learning_rate=3e-3, log_every=25, progress=False, cpu_devices=0, api="nnx")
  return dataclasses.replace(lm.get_config("tiny_cpu"), **{**base, **kw})


def _load(model, kind, tree):
  """Sets ``model``'s variables of ``kind`` from a Linen collection (the same paths)."""
  state = nnx.state(model, kind)
  nnx.replace_by_pure_dict(state, tree)
  nnx.update(model, state)


def _assert_same_paths_and_shapes(model, kind, tree):
  mine = nnx.to_pure_dict(nnx.state(model, kind))
  assert jax.tree_util.tree_structure(mine) == jax.tree_util.tree_structure(tree)
  assert jax.tree.leaves(jax.tree.map(lambda a, b: a.shape == b.shape, mine, tree)) == [
      True] * len(jax.tree.leaves(tree))


@pytest.mark.parametrize("tied", [True, False])
def test_nnx_gpt_with_the_linen_weights_gives_the_linen_logits(tied):
  config = _small(tied=tied, num_layers=2, width=64)
  linen = lm.create_model(config)
  params = jax.jit(linen.init)(jax.random.PRNGKey(1), jnp.zeros((1, 32), jnp.int32))["params"]
  model = lm_nnx.create_model(config)
  _assert_same_paths_and_shapes(model, nnx.Param, params)
  assert lm_nnx.param_count(model) == sum(np.size(p) for p in jax.tree.leaves(params))
  _load(model, nnx.Param, params)
  tokens = np.random.default_rng(0).integers(0, 27, (2, 32)).astype(np.int32)
  np.testing.assert_allclose(np.asarray(model(tokens)),
                             np.asarray(linen.apply({"params": params}, tokens)),
                             rtol=1e-6, atol=1e-6)


def test_nnx_gpt_starts_from_the_linen_gpts_distributions():
  """Leaf by leaf: the constants (LayerNorm scales, biases) equal, the normal ones' standard
  deviations within 5% of each other (each has >= 4,096 values: sampling error ~1%)."""
  config = _small(num_layers=2)
  linen = jax.jit(lm.create_model(config).init)(jax.random.PRNGKey(1),
                                                jnp.zeros((1, 32), jnp.int32))["params"]
  mine = nnx.to_pure_dict(nnx.state(lm_nnx.create_model(config), nnx.Param))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(linen), jax.tree.leaves(mine)):
    a, b, name = np.asarray(a), np.asarray(b), jax.tree_util.keystr(path)
    if np.ptp(a) == 0:
      np.testing.assert_array_equal(b, a, err_msg=name)
    else:
      assert a.size >= 4096 and b.std() == pytest.approx(a.std(), rel=0.05), name


# Two blocks in the first stage, one in each other: a block with a projection, one without, and a
# strided one in every later stage; ResNet-18 and -50 repeat the same blocks (8 and 16 of them:
# the compiles take 2-3x longer, ~24 s and ~48 s on 2 cores).
STAGES = (2, 1, 1, 1)


def _resnet_pair(block, stem, size):
  """The Linen ResNet, variables for it and its NNX twin (abstract, to be loaded with them). The
  variables are drawn in NumPy from the shapes alone: initializing either model compiles its
  random initializers (~4 s each on 2 cores) only for the values to be replaced. BatchNorm's scales
  and variances near 1, its biases and means near 0 (not the 1 / 0 they start at), the kernels at
  He's scale."""
  linen = models.ResNet(STAGES, getattr(models, block), num_classes=5, width=4, stem=stem,
                        norm="flax")
  shapes = jax.eval_shape(lambda: linen.init(jax.random.key(1), jnp.zeros((1, size, size, 3)),
                                             train=False))
  rng = np.random.default_rng(3)

  def draw(path, x):
    name = jax.tree_util.keystr(path)
    z = rng.standard_normal(x.shape).astype(np.float32)
    if name.endswith("['kernel']"):
      return z * np.float32(np.sqrt(2 / np.prod(x.shape[:-1])))
    return np.float32("scale']" in name or "var']" in name) + 0.1 * z
  variables = jax.tree_util.tree_map_with_path(draw, shapes)
  model = nnx.eval_shape(lambda: models_nnx.ResNet(STAGES, getattr(models_nnx, block), 5, width=4,
                                                   stem=stem, rngs=nnx.Rngs(0)))
  return linen, variables, model


def test_the_nnx_resnets_have_the_linen_depths():
  """What the twins below leave out: the depths' stages and blocks are the Linen ones."""
  assert models_nnx.STAGE_SIZES is models.STAGE_SIZES
  assert models.resnet(18).block is models.BasicBlock
  assert models.resnet(50).block is models.BottleneckBlock
  for module, kw in ((models, {}), (models_nnx, {"rngs": nnx.Rngs(0)})):
    with pytest.raises(ValueError, match="depth must be one of"):
      module.resnet(51, **kw)


@pytest.mark.slow   # two ResNets compiled six times each (~6 s basic blocks, ~10 s bottlenecks)
@pytest.mark.parametrize("block,stem,size", [("BasicBlock", "cifar", 8),
                                             ("BottleneckBlock", "imagenet", 32)])
def test_nnx_resnet_with_the_linen_variables_gives_the_linen_logits_and_statistics(block, stem,
                                                                                   size):
  linen, variables, model = _resnet_pair(block, stem, size)
  _assert_same_paths_and_shapes(model, nnx.Param, variables["params"])
  _assert_same_paths_and_shapes(model, nnx.BatchStat, variables["batch_stats"])
  _load(model, nnx.Param, variables["params"])
  _load(model, nnx.BatchStat, variables["batch_stats"])
  x = np.random.default_rng(0).normal(size=(4, size, size, 3)).astype(np.float32)
  forward = nnx.jit(lambda model, x: model(x))   # compiled: eager ops compile one by one
  model.eval()
  np.testing.assert_allclose(np.asarray(forward(model, x)),
                             np.asarray(jax.jit(linen.apply, static_argnames="train")(
                                 variables, x, train=False)), atol=1e-5)
  model.train()
  want, updates = jax.jit(lambda v, x: linen.apply(v, x, train=True, mutable=["batch_stats"]))(
      variables, x)
  np.testing.assert_allclose(np.asarray(forward(model, x)), np.asarray(want), atol=1e-5)
  got = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(updates["batch_stats"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _assert_params_close(got, want, width, learning_rate):
  """Within 1% of one Adam step (<= the learning rate per element): the two programs sum the
  gradient in other orders, and Adam turns the rounding of a near-zero gradient into a step of a
  fraction of the learning rate (a few elements of 200k); and the attention's key bias, whose
  gradient is zero in exact arithmetic (softmax ignores a shift of a query's scores), within
  3 steps (tests/test_lm_recipe.py)."""
  g, w = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (got, want))
  off = 0
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(w), jax.tree.leaves(g)):
    a, b, name = np.asarray(a), np.asarray(b), jax.tree_util.keystr(path)
    if name.endswith("['qkv']['bias']"):
      assert np.abs(b[width:2 * width] - a[width:2 * width]).max() <= 3 * learning_rate
      a, b = np.delete(a, np.s_[width:2 * width]), np.delete(b, np.s_[width:2 * width])
    assert np.abs(b - a).max() <= 0.01 * learning_rate, name
    off += int(np.sum(~np.isclose(b, a, rtol=1e-5, atol=1e-6)))
  assert off <= 1e-4 * sum(np.size(x) for x in jax.tree.leaves(w)), off


@pytest.mark.parametrize("shard", [   # each: an 8-replica step and nnx.jit's, compiled (~5 s)
    "none", pytest.param("params", marks=pytest.mark.slow)])
def test_nnx_lm_step_equals_the_one_device_nnx_jit_step(shard):
  config = _small(warmup_steps=0, shard=shard)   # no warm-up: the first update is not zero
  tx, schedule = lm.make_optimizer(config)
  got, want = lm_nnx.create_objects(config, tx), lm_nnx.create_objects(config, tx)
  step = lm_nnx.make_train_step(config, schedule)
  reference = nnx.jit(lm_nnx.train_step_fn(schedule, nnx.value_and_grad))
  batches = lm_data.batches(lm_data.sequences("markov", "train", 256, config.context),
                            config.batch_size)
  with jax.numpy_dtype_promotion("standard"):   # optax's bias correction: float ** int32
    for _ in range(3):
      batch = next(batches)
      metrics, expected = step(*got, batch), reference(*want, batch)
      assert float(metrics["loss"]) == pytest.approx(float(expected["loss"]), rel=1e-5)
      assert float(metrics["learning_rate"]) == pytest.approx(float(expected["learning_rate"]),
                                                              rel=1e-6)
  assert int(got[1].step[...]) == 3
  _assert_params_close(got[0], want[0], config.width, config.learning_rate)


@pytest.mark.slow   # 100 LM steps and a resume (~25 s)
def test_nnx_lm_recipe_trains_below_the_unigram_entropy_and_resumes(tmp_path):
  config = _small(workdir=str(tmp_path), checkpoint_every=50)
  summary = lm.train_and_evaluate(config)
  losses = summary["losses"]
  assert len(losses) == 100 and np.all(np.isfinite(losses))
  assert np.mean(losses[-10:]) < 0.6 * summary["unigram_entropy"] < np.mean(losses[:3])
  final = summary["final"]
  assert final["eval_loss"] < 0.6 * summary["unigram_entropy"], final
  assert final["eval_perplexity"] == pytest.approx(np.exp(final["eval_loss"]))
  model, optimizer = summary["state"]
  assert int(optimizer.step[...]) == 100
  d = 128   # embeddings (32 tokens, 32 positions), 12 d^2 + 13 d per layer, the final LayerNorm
  assert summary["params"] == lm_nnx.param_count(model) == 2 * 32 * d + 12 * d * d + 15 * d
  resumed = lm.train_and_evaluate(config)    # finds step 100: restores, trains nothing
  assert resumed["start_step"] == 100 and resumed["losses"] == []
  assert resumed["final"]["eval_loss"] == pytest.approx(final["eval_loss"], rel=1e-6)


def test_lm_config_api_is_checked():
  assert lm.parse_args(["--config.api=nnx"]).api == "nnx"
  with pytest.raises(ValueError, match="api"):
    lm.train_and_evaluate(_small(api="haiku"))


@pytest.mark.slow   # trains and compiles the demo (~12 s)
def test_demo_api_nnx_reports(tmp_path):
  from recipes import demo, small_cpu
  config = dataclasses.replace(
      small_cpu.get_config(), width=4, image_size=16, num_classes=4, train_per_class=16,
      val_per_class=4, generated_image_size=16, data_dir=str(tmp_path / "gen"), batch_size=32,
      eval_batch_size=16, num_steps=3, warmup_epochs=0.0, learning_rate=1.6,
      compression="int8", log_every=1, progress=False)
  report = demo.run(config, api="nnx")
  assert report["steps"] == 3 and report["devices"] == 8 and report["api"] == "nnx"
  assert 0.0 <= report["top1"] <= report["top5"] <= 1.0 and report["images_per_s"] > 0
  assert report["eval_images"] == 16
  wire = report["wire_bytes"]   # from the NNX step's compiled HLO, int8 against uncompressed
  assert 0 < wire["compressed"] < wire["uncompressed"] / 3, wire
  text = demo.format_report(report)
  for field in ("(NNX)", "top-1", "top-5", "images/s", "int8", "x less", "chance is 25%"):
    assert field in text, field
  assert demo._parser().parse_args([]).api == "linen"


@pytest.mark.parametrize("name", [   # a fresh interpreter each (~7-8 s): one in the quick loop
    "plain_jax", pytest.param("equinox_mlp", marks=pytest.mark.slow),
    pytest.param("nnx_mlp", marks=pytest.mark.slow)])
def test_example_runs_and_its_loss_falls(name):
  proc = subprocess.run([sys.executable, f"recipes/examples/{name}.py"], cwd=multiproc.REPO,
                        env=multiproc.clean_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  losses = [float(x) for x in re.findall(r"^(?:step|epoch)\s+\d+\s+loss (\S+)", proc.stdout,
                                         re.MULTILINE)]
  assert len(losses) >= 3 and np.all(np.isfinite(losses)), proc.stdout
  assert losses[-1] < 0.5 * losses[0], proc.stdout
