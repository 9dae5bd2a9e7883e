"""Data-parallel training on real data (scikit-learn's bundled digits) with compressed gradients.

A 64-64-10 MLP, full-batch on 8 members (180 training images each), plain SGD for a fixed budget,
gradients averaged by ``jaxring.reduce_gradients``. With error feedback, int8 must end within
0.5 accuracy points of uncompressed and top-k chunks (1%) within 1.5; the runs without error
feedback are printed for comparison (``pytest -s``).

The task, the model and the training loop are the benchmark's (``jaxring bench convergence``,
jaxring._src.tools.bench.convergence): one source, so the test checks what the benchmark reports.
Plain SGD, not momentum after the reduction: momentum over top-k needs momentum correction
(tests/test_convergence_compressed.py).
"""
import time

import pytest

from jaxring import codecs

pytest.importorskip("sklearn.datasets", reason="needs scikit-learn's digits")
from jaxring._src.tools.bench import convergence as bench  # noqa: E402

# `pytest -m "not slow"` leaves it out: trains three classifiers to convergence (~15 s)
pytestmark = pytest.mark.slow

STEPS, LR = 300, 0.5
CONFIGS = {
    "uncompressed": (None, True),
    "int8+EF": (codecs.int8(), True),
    "int8 no EF": (codecs.int8(), False),
    "topk 1%+EF": (codecs.topk_chunks(0.01, chunk_size=16), True),
    "topk 1% no EF": (codecs.topk_chunks(0.01, chunk_size=16), False),
}


@pytest.fixture(scope="module")
def accuracies():
  data = bench.digits()
  acc = {}
  print(f"\ndigits MLP, 8 members, {STEPS} full-batch SGD steps (lr {LR}):")
  for name, (codec, ef) in CONFIGS.items():
    t = time.perf_counter()
    # train_digits also checks that every member ends with the same parameters
    acc[name] = bench.train_digits(bench.naive_optimizer("sgd", LR, "d", codec, ef), STEPS,
                                   data)[0]
    print(f"  {name:14s} test accuracy {acc[name]:6.2f}%   ({time.perf_counter() - t:.1f} s)")
  return acc


def test_uncompressed_baseline_learns(accuracies):
  assert accuracies["uncompressed"] > 95.0


def test_int8_with_error_feedback_matches_uncompressed(accuracies):
  assert abs(accuracies["int8+EF"] - accuracies["uncompressed"]) <= 0.5


def test_topk_with_error_feedback_within_1_5_points(accuracies):
  assert abs(accuracies["topk 1%+EF"] - accuracies["uncompressed"]) <= 1.5


def test_a_diverged_run_is_reported_as_nan_and_drifting_replicas_as_a_defect():
  import numpy as np
  convergence = bench
  assert convergence._replicas_agree({"w": np.ones((8, 3)), "b": np.zeros((8,))})
  assert not convergence._replicas_agree({"w": np.full((8, 3), np.nan)})
  assert not convergence._replicas_agree({"w": np.full((8, 3), np.inf)})
  drifted = np.ones((8, 3))
  drifted[5, 2] += 1e-6
  with pytest.raises(AssertionError, match="different parameters"):
    convergence._replicas_agree({"w": drifted})
