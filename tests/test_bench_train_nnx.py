"""``jaxring bench train --api nnx`` times contenders that train alike: the NNX step through
``@jaxring.train_step`` and the hand-written ``nnx.split`` + ``jit(shard_map)`` + ``lax.pmean``
step, each from the same initialization on the same batches, reach the same losses (three steps of
a width-2 network: too few for rounding differences to grow), and one update from the same state
gives the same loss."""
from __future__ import annotations

import argparse

import jax
import numpy as np
import pytest

from jaxring._src.tools.bench import train_nnx

pytestmark = pytest.mark.slow   # compiles two ResNet-18 steps (~15 s on 2 cores)


def test_nnx_contenders_train_alike():
  args = argparse.Namespace(width=2, batch_per_device=1, bucket_mib=0.0, reps=1, steps=1,
                            warmup=1, int8=False)
  result = train_nnx.run(args)
  rows = {r["contender"]: r for r in result["rows"]}
  base = rows.pop(train_nnx.HAND_WRITTEN)
  assert result["devices"] == jax.device_count() == 8 and result["trained_steps"] == 2
  assert rows and base["last_loss"] != base["first_loss"]   # the steps trained
  for name, row in rows.items():
    assert row["buckets"] == 1, name
    np.testing.assert_allclose(row["first_loss"], base["first_loss"], rtol=2e-6, err_msg=name)
    np.testing.assert_allclose(row["last_loss"], base["last_loss"], rtol=2e-6, err_msg=name)
    np.testing.assert_allclose(row["synced_loss"], base["synced_loss"], rtol=2e-6, err_msg=name)
