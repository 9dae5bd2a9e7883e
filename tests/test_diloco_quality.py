"""``jaxring bench diloco-quality``: its DiLoCo at every=1 with averaging is its synchronous run,
at H=2 it is not, and the gaps are paired by seed (the runs themselves: docs/benchmarks.md)."""
import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxring._src.data.hard_shapes import hard_shapes
from jaxring._src.tools.bench import diloco_quality as dq


@pytest.mark.slow   # three small ResNet runs of 4 steps, compiled (~15 s)
def test_every_1_averaging_is_the_synchronous_run_and_h2_is_not():
  mesh = jax.make_mesh((4, 2), ("node", "local"), axis_types=(AxisType.Auto,) * 2)
  data = hard_shapes(num_train=512, num_test=64)
  kw = dict(steps=4, lr=0.05, seed=0, data=data, mesh=mesh)
  with jax.numpy_dtype_promotion("standard"):   # optax's cosine schedule: int32 count * float
    sync = dq.train(None, None, 0, **kw)
    each = dq.train(1, "average", 0, **kw)
    apart = dq.train(2, "average", 0, **kw)
  for a, b in zip(jax.tree.leaves(sync), jax.tree.leaves(each)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
  assert not all(np.allclose(a, b, rtol=1e-3) for a, b in zip(jax.tree.leaves(sync),
                                                              jax.tree.leaves(apart)))
  assert 0 <= dq.accuracy(sync, data) <= 100


def test_rows_pair_the_gaps_by_seed():
  base = dq.row_of(dq.Contender("synchronous", None, None, 0), [0, 1], [90.0, 86.0])
  row = dq.row_of(dq.Contender("diloco", 20, "average", 300, "int8"), [0, 1], [89.0, 87.5], base)
  assert (row["contender"], row["every"], row["codec"], row["decay"]) == \
      ("diloco", 20, "int8", None) and "name" not in row
  assert row["gaps"] == pytest.approx([-1.0, 1.5]) and row["gap"] == pytest.approx(0.25)
  assert base["gap"] == 0.0 and row["mean"] == pytest.approx(88.25)
  names = [c[0] for c in dq.contenders([20, 100], ["average"], [0, 300])]
  coded = [c[0] for c in dq.contenders([20], ["average"], [0], ["none", "topk"])]
  assert coded[1:] == ["diloco H=20 average warmup=0", "diloco H=20 average warmup=0 topk"]
  decayed = dq.contenders([20], ["nesterov"], [0], ["none", "topk"], [1.0, 0.9])
  assert [c.name for c in decayed[1:]] == ["diloco H=20 nesterov warmup=0",
                                           "diloco H=20 nesterov warmup=0 topk decay=1",
                                           "diloco H=20 nesterov warmup=0 topk decay=0.9"]
  assert [c.decay for c in decayed] == [None, None, 1.0, 0.9]
  assert names[0] == "synchronous" and "diloco H=100 average warmup=300" in names
  assert len(names) == 5
