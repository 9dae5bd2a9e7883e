"""The recipes: ResNet v1.5, the optimizer, losses and metrics against NumPy, a small config trained
on 8 devices with checkpoint and resume, and the demo's report."""
import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from recipes import models, optim, train
from recipes.config import Config, override


def _resnet50_variables(image_size=224):
  model = models.resnet(50)
  return model, jax.eval_shape(lambda: model.init(
      jax.random.PRNGKey(0), jnp.zeros((1, image_size, image_size, 3)), train=False))


def test_resnet50_has_torchvision_parameter_count():
  _, variables = _resnet50_variables()
  count = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(variables["params"]))
  assert count == 25_557_032  # torchvision resnet50, 1000 classes


def test_resnet50_v15_downsamples_on_the_3x3_conv():
  model, variables = _resnet50_variables()

  def shapes(variables):
    _, state = model.apply(variables, jnp.zeros((1, 224, 224, 3)), train=False,
                           capture_intermediates=True, mutable=["intermediates"])
    return state["intermediates"]
  inter = jax.eval_shape(shapes, variables)
  block = inter["stage2_block1"]                   # the first block that downsamples: 56 -> 28
  assert block["conv1"]["__call__"][0].shape[1:3] == (56, 56)   # 1x1: stride 1 (v1: stride 2)
  assert block["conv2"]["__call__"][0].shape[1:3] == (28, 28)   # 3x3 carries the stride
  assert block["proj_conv"]["__call__"][0].shape[1:3] == (28, 28)
  assert inter["stage4_block3"]["conv3"]["__call__"][0].shape == (1, 7, 7, 2048)


def _reference_lr(step, peak, total, warmup):
  if step < warmup:
    return peak * step / warmup
  t = min(step - warmup, total - warmup) / (total - warmup)
  return peak * 0.5 * (1 + math.cos(math.pi * t))


def test_learning_rate_schedule_matches_numpy():
  peak = optim.peak_learning_rate(0.1, 1024)
  assert peak == pytest.approx(0.4)
  assert optim.peak_learning_rate(0.1, 1024, "none") == 0.1
  total, warmup = 1000, 50
  schedule = optim.learning_rate_schedule(peak, total, warmup)
  for step in (0, 1, 25, 49, 50, 51, 300, 525, 999, 1000):
    assert float(schedule(step)) == pytest.approx(_reference_lr(step, 0.4, total, warmup),
                                                  rel=1e-5, abs=1e-7), step
  with pytest.raises(ValueError):
    optim.learning_rate_schedule(peak, 10, 10)


def _bn_channels_resnet50():
  total = 64  # stem
  for i, blocks in enumerate((3, 4, 6, 3)):
    w = 64 * 2 ** i
    total += blocks * (w + w + 4 * w) + 4 * w  # bn1, bn2, bn3 per block; the projection's bn
  return total


def test_weight_decay_mask_excludes_exactly_batchnorm_and_biases():
  _, variables = _resnet50_variables()
  params = variables["params"]
  mask = optim.weight_decay_mask(params)
  flat = jax.tree_util.tree_leaves_with_path(params)
  flat_mask = jax.tree_util.tree_leaves(mask)
  decayed = [(p, x) for (p, x), m in zip(flat, flat_mask) if m]
  kept = [(p, x) for (p, x), m in zip(flat, flat_mask) if not m]
  assert len(decayed) == 53 + 1                # 53 convolutions + the classifier's kernel
  assert all(len(x.shape) in (2, 4) for _, x in decayed)
  assert len(kept) == 2 * 53 + 1               # scale and bias of 53 BatchNorms + head bias
  assert all(len(x.shape) == 1 for _, x in kept)
  decayed_size = sum(int(np.prod(x.shape)) for _, x in decayed)
  assert decayed_size == 25_557_032 - 1000 - 2 * _bn_channels_resnet50()


@pytest.mark.slow   # compiles two optimizers' updates of a ResNet-18's parameters (~5 s)
def test_sgd_decays_only_kernels_with_nesterov_momentum():
  model = models.resnet(18, num_classes=10, width=4, stem="cifar")
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)),
                                             train=False))["params"]
  rng = np.random.default_rng(0)   # drawn in NumPy: initializing compiles the initializers (~4 s)
  params = jax.tree_util.tree_map(   # nonzero everywhere (BN biases start at 0)
      lambda s: jnp.asarray(0.5 + rng.standard_normal(s.shape), s.dtype), shapes)
  lr, wd, mom = 0.3, 1e-2, 0.9

  def zero_grad_update(tx):
    return jax.jit(lambda p: tx.update(jax.tree_util.tree_map(jnp.zeros_like, p), tx.init(p),
                                       p)[0])(params)
  updates = zero_grad_update(
      optim.make_optimizer(optax.constant_schedule(lr), momentum=mom, weight_decay=wd))
  for (path, p), u in zip(jax.tree_util.tree_leaves_with_path(params),
                          jax.tree_util.tree_leaves(updates)):
    is_kernel = path[-1].key == "kernel"
    # zero gradient: the step is the decay alone; Nesterov applies the fresh trace twice (1 + mu)
    expected = -lr * (1 + mom) * wd * np.asarray(p, np.float64) if is_kernel else 0.0
    np.testing.assert_allclose(np.asarray(u, np.float64), expected, rtol=1e-5, atol=0)
  updates = zero_grad_update(
      optim.make_optimizer(optax.constant_schedule(lr), optimizer="lars", weight_decay=wd))
  for path, u in jax.tree_util.tree_leaves_with_path(updates):
    assert (np.abs(np.asarray(u)).max() > 0) == (path[-1].key == "kernel"), path


def test_label_smoothed_cross_entropy_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 3, (16, 7))
  labels = rng.integers(0, 7, 16)
  for eps in (0.0, 0.1, 0.5):
    targets = np.full((16, 7), eps / 7) + (1 - eps) * np.eye(7)[labels]
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    expected = -(targets * logp).sum(-1).mean()
    got = train.cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(labels, jnp.int32),
                              eps)
    assert float(got) == pytest.approx(expected, rel=1e-5)


def test_top1_top5_match_numpy():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(64, 20))
  labels = rng.integers(0, 20, 64)
  order = np.argsort(-logits, axis=-1)
  got = train.topk_correct(jnp.asarray(logits, jnp.float32), jnp.asarray(labels, jnp.int32))
  for k in (1, 5):
    expected = (order[:, :k] == labels[:, None]).any(-1)
    np.testing.assert_array_equal(np.asarray(got[f"top{k}"]), expected)
  assert 0 < expected.mean() < 1


def test_config_overrides_both_spellings():
  c = override(Config(), ["--config.batch_size=64", "--num-steps", "10", "--nesterov=false",
                          "--config.compression", "int8", "--progress"])
  assert (c.batch_size, c.num_steps, c.nesterov, c.compression, c.progress) == (64, 10, False,
                                                                              "int8", True)
  with pytest.raises(ValueError, match="unknown config field"):
    override(Config(), ["--batchsize=3"])


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
  """A 4-class generated data set at 16 px and a width-4 ResNet-18: seconds on 2 cores."""
  from recipes import small_cpu
  return dataclasses.replace(
      small_cpu.get_config(), width=4, image_size=16, num_classes=4, train_per_class=16,
      val_per_class=4, generated_image_size=16, data_dir=str(tmp_path_factory.mktemp("gen")),
      batch_size=32, eval_batch_size=16, num_steps=8, warmup_epochs=0.0, learning_rate=1.6,
      compression="none", log_every=1, checkpoint_every=4, progress=False)


@pytest.mark.slow   # trains the small config twice (~14 s)
def test_small_config_trains_on_8_devices_and_resumes(tiny_config, tmp_path):
  config = dataclasses.replace(tiny_config, workdir=str(tmp_path))
  summary = train.train_and_evaluate(config)
  assert summary["devices"] == 8 and summary["steps"] == 8
  with open(tmp_path / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  losses = [r["loss"] for r in records if "loss" in r]
  assert len(losses) == 7                         # step 1 compiles and is not logged
  assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.1, losses
  assert 0.0 <= summary["final"]["eval_top1"] <= summary["final"]["eval_top5"] <= 1.0
  assert summary["final"]["eval_images"] == 16
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4", "8"]

  resumed = train.train_and_evaluate(config)    # finds step 8: restores, trains nothing
  assert resumed["start_step"] == 8
  for a, b in zip(jax.tree_util.tree_leaves(summary["state"].params),
                  jax.tree_util.tree_leaves(resumed["state"].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert resumed["final"]["eval_top1"] == summary["final"]["eval_top1"]


@pytest.mark.slow   # a short fully sharded recipe run (~9 s)
@pytest.mark.timeout(600)
def test_small_config_trains_fully_sharded_with_int8_weights(tiny_config, tmp_path):
  """--config.shard=params --config.param_compression=int8: parameters and momentum live split
  over the 8 devices, training lowers the loss, evaluation reads the split parameters, and the
  checkpoints are written (their exact resume: test_train_shard_hpz_checkpoint.py)."""
  config = dataclasses.replace(tiny_config, workdir=str(tmp_path), shard="params",
                               param_compression="int8", compression="int8", algorithm="ring")
  summary = train.train_and_evaluate(config)
  kernel = summary["state"].params["head"]["kernel"]  # (32, 4): split along the 32
  assert "data" in str(kernel.sharding.spec)
  with open(tmp_path / "metrics.jsonl") as f:
    losses = [json.loads(line)["loss"] for line in f if "loss" in json.loads(line)]
  assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.1, losses
  assert summary["final"]["eval_images"] == 16
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4", "8"]  # saved sharded
  with pytest.raises(ValueError, match="param_compression"):
    train.make_train_step(dataclasses.replace(tiny_config, param_compression="int8"),
                          lambda s: 0.1)
  hpz = dataclasses.replace(tiny_config, shard="params", mesh="hierarchical", hpz=True)
  assert train.make_train_step(hpz, lambda s: 0.1).config.split_axes == ("local", "node")
  with pytest.raises(ValueError, match="hierarchical axis_name"):
    train.make_train_step(dataclasses.replace(hpz, mesh="flat"), lambda s: 0.1)


@pytest.mark.slow   # trains and compiles the demo (~12 s)
def test_demo_report_has_its_fields_and_a_short_run_clips_the_warm_up_instead_of_refusing(
    tiny_config):
  from recipes import demo
  # 50 epochs of warm-up in a 3-step run: clipped to a tenth of the run (the schedule refuses a
  # warm-up as long as the run); the demo trains through recipes.train.train_and_evaluate
  config = dataclasses.replace(tiny_config, compression="int8", num_steps=3, warmup_epochs=50.0)
  with pytest.raises(ValueError):
    optim.learning_rate_schedule(0.1, 3, 50 * 2)
  report = demo.run(config)
  assert report["steps"] == 3 and report["devices"] == 8 and report["compression"] == "int8"
  assert 0.0 <= report["top1"] <= 1.0 and report["images_per_s"] > 0
  wire = report["wire_bytes"]
  # 4 bytes per gradient value vs ~1 byte plus block scales; all-reduce sends 2(p-1)/p of it
  assert 2 * 7 / 8 * 4 * report["params"] <= wire["uncompressed"] <= 1.1 * 2 * 7 / 8 * 4 * report[
      "params"]
  assert 3.0 < wire["uncompressed"] / wire["compressed"] < 4.0
  text = demo.format_report(report)
  for field in ("top-1", "top-5", "images/s", "int8", "uncompressed", "chance is 25%"):
    assert field in text, field


def test_demo_report_describes_one_gpu_without_nan():
  from recipes import demo
  report = {"params": 1000, "steps": 3, "global_batch": 8, "devices": 1, "compression": "int8",
            "platform": "gpu", "top1": 0.5, "top5": 0.9, "eval_images": 10, "num_classes": 4,
            "images_per_s": 100.0, "wire_bytes": {"compressed": 0, "uncompressed": 0},
            "train_s": 1.0, "compile_s": 0.5}
  text = demo.format_report(report)
  assert "on 1 GPU device," in text and "nan" not in text and "one device sends nothing" in text
  assert "emulated" not in text
