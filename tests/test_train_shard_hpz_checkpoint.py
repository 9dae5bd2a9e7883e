"""hpZ (a node-local copy of the gathered parameters) and orbax checkpoints of sharded state."""
import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxring
import jaxring.train as jt

from sharded_models import _assert_trees_close, _data, _mlp_state, _mlp_step, _run


def _gather_groups(text: str) -> dict:
  """How many all-gathers the lowered program has, by the shape of their replica groups."""
  import re
  shapes = re.findall(r'"stablehlo.all_gather"\(.*?replica_groups = dense<.*?> : tensor<(\w+)xi64>',
                      text)
  return {k: shapes.count(k) for k in set(shapes)}


def test_hpz_gathers_across_nodes_once_and_within_the_node_in_the_backward_pass():
  """2 nodes x 4: without hpZ every gather spans the 8 devices (6 forward + 2 backward, as
  above); with it the forward pass gathers each split leaf across the nodes (groups of 2) then
  within the node (groups of 4), and the backward pass only within the node again."""
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("node", "local"))
  batch = _data(1, shape=(16,), classes=8)[0]
  groups = {}
  for hpz in (False, True):
    step = _mlp_step(mesh=mesh, axis_name=("node", "local"), shard="params", hpz=hpz)
    groups[hpz] = _gather_groups(step.lower(_mlp_state(optax.sgd(0.1)), batch).as_text())
  assert groups[False] == {"1x8": 6 + 2}
  assert groups[True] == {"4x2": 6, "2x4": 6 + 2}


@pytest.mark.slow   # trains twice side by side (~1.5 s)
def test_hpz_with_int8_parameters_across_nodes_trains_like_uncompressed():
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("node", "local"))
  batches = _data(30, shape=(16,), classes=8)
  kw = dict(mesh=mesh, axis_name=("node", "local"), shard="params", algorithm="hierarchical")
  plain, m_plain = _run(_mlp_step(**kw), _mlp_state(optax.sgd(0.1, momentum=0.9)), batches)
  both = {"params": {"node": jaxring.codecs.int8()}, "grads": {"node": jaxring.codecs.int8()}}
  comp, m_comp = _run(_mlp_step(hpz=True, compression=both, **kw),
                      _mlp_state(optax.sgd(0.1, momentum=0.9)), batches)
  first = float(_mlp_step(**kw)(_mlp_state(optax.sgd(0.0)), batches[0])[1]["loss"])
  assert float(m_comp["loss"]) < 0.8 * first
  assert abs(float(m_comp["loss"]) - float(m_plain["loss"])) < 0.05 * float(m_plain["loss"])
  diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(comp.params), jax.tree.leaves(plain.params)))
  assert diff > 0  # the weights travelled quantized


@pytest.mark.slow   # trains, saves and restores twice (~5 s)
def test_checkpoint_of_a_sharded_state_resumes_exactly_and_restores_on_fewer_devices(tmp_path):
  step = _mlp_step(shard="params", algorithm="ring",
                   compression={"grads": jaxring.codecs.int8(block_size=32)})
  batches = _data(5, shape=(16,), classes=8)
  state, _ = _run(step, _mlp_state(optax.adam(1e-2)), batches[:3])
  with jt.Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state, step=3)
    ckpt.wait_until_finished()
  saved = jax.device_get((state.params, state.opt_state))
  saved_residuals = jax.device_get(state.residuals.tree)
  straight, _ = _run(step, state, batches[3:])  # (donates state)
  with jt.Checkpointer(tmp_path / "ckpt") as ckpt, jax.numpy_dtype_promotion("standard"):
    restored, _ = ckpt.restore(step.prepare(_mlp_state(optax.adam(1e-2))))
  assert "data" in str(restored.params["Dense_0"]["kernel"].sharding.spec)
  resumed, _ = _run(step, restored, batches[3:])
  for a, b in zip(jax.tree.leaves((straight.params, straight.opt_state, straight.residuals)),
                  jax.tree.leaves((resumed.params, resumed.opt_state, resumed.residuals))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # the same checkpoint on a 4-device mesh: parameters and optimizer state as saved, and each
  # replica's residual the mean of the 8 saved ones (what they add back to the mean is kept)
  small = Mesh(np.asarray(jax.devices()[:4]), ("data",))
  step4 = _mlp_step(mesh=small, shard="params", algorithm="ring",
                    compression={"grads": jaxring.codecs.int8(block_size=32)})
  with jt.Checkpointer(tmp_path / "ckpt") as ckpt, jax.numpy_dtype_promotion("standard"):
    on4, _ = ckpt.restore(step4.prepare(_mlp_state(optax.adam(1e-2))))
  assert on4.params["Dense_0"]["kernel"].sharding.mesh.devices.size == 4
  _assert_trees_close((on4.params, on4.opt_state), saved, rtol=0, atol=0)
  for r8, r4 in zip(jax.tree.leaves(saved_residuals), jax.tree.leaves(on4.residuals)):
    assert r4.shape == (4,) + r8.shape[1:]
    np.testing.assert_allclose(np.asarray(r4).sum(0) / 4, np.asarray(r8).sum(0) / 8, rtol=1e-6,
                               atol=1e-9)
  _run(step4, on4, batches[3:4])  # and it trains there


@pytest.mark.slow   # trains, saves and restores under two meshes (~1.5 s)
def test_an_hpz_checkpoint_restores_into_a_flat_step_and_back(tmp_path):
  """hpZ orders the blocks local-major (spec ("local", "node")); a checkpoint holds the global
  arrays, so a step without hpZ on a flat 8-device mesh restores them as saved, trains, and its
  checkpoint restores into the hpZ step again."""
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("node", "local"))
  hpz = _mlp_step(mesh=mesh, axis_name=("node", "local"), shard="params", hpz=True)
  flat = _mlp_step(shard="params")
  batches = _data(3, shape=(16,), classes=8)
  state, _ = _run(hpz, _mlp_state(optax.adam(1e-2)), batches[:2])
  assert state.params["Dense_0"]["kernel"].sharding.spec[1] == ("local", "node")
  saved = jax.device_get((state.params, state.opt_state))
  with jt.Checkpointer(tmp_path / "a") as ckpt:
    ckpt.save(state, step=2)
    ckpt.wait_until_finished()
  with jt.Checkpointer(tmp_path / "a") as ckpt, jax.numpy_dtype_promotion("standard"):
    on_flat, _ = ckpt.restore(flat.prepare(_mlp_state(optax.adam(1e-2))))
  assert on_flat.params["Dense_0"]["kernel"].sharding.spec[1] == "data"
  _assert_trees_close((on_flat.params, on_flat.opt_state), saved, rtol=0, atol=0)
  on_flat, _ = _run(flat, on_flat, batches[2:])
  trained = jax.device_get((on_flat.params, on_flat.opt_state))
  with jt.Checkpointer(tmp_path / "b") as ckpt:
    ckpt.save(on_flat, step=3)
    ckpt.wait_until_finished()
  with jt.Checkpointer(tmp_path / "b") as ckpt, jax.numpy_dtype_promotion("standard"):
    back, _ = ckpt.restore(hpz.prepare(_mlp_state(optax.adam(1e-2))))
  assert back.params["Dense_0"]["kernel"].sharding.spec[1] == ("local", "node")
  _assert_trees_close((back.params, back.opt_state), trained, rtol=0, atol=0)
