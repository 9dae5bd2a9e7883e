"""jaxring.data.hard_shapes: deterministic, balanced, noisy training labels and clean test ones."""
import numpy as np

from jaxring.data import hard_shapes


def test_deterministic_shapes_and_dtypes():
  a = hard_shapes(512, 128, seed=3)
  b = hard_shapes(512, 128, seed=3)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  x, y, xt, yt = a
  assert x.shape == (512, 16, 16, 3) and xt.shape == (128, 16, 16, 3)
  assert x.dtype == np.float32 and y.dtype == np.int32
  assert not np.array_equal(hard_shapes(64, 8, seed=4)[0], hard_shapes(64, 8, seed=3)[0])


def test_label_noise_touches_only_training_labels():
  clean = hard_shapes(4096, 1024, label_noise=0.0)
  noisy = hard_shapes(4096, 1024, label_noise=0.1)
  np.testing.assert_array_equal(clean[0], noisy[0])          # same images
  np.testing.assert_array_equal(clean[3], noisy[3])          # clean test labels
  changed = np.mean(clean[1] != noisy[1])
  assert abs(changed - 0.1 * 15 / 16) < 0.02                  # a random class: 1/16 unchanged
  counts = np.bincount(np.concatenate([clean[1], clean[3]]), minlength=16)
  assert counts.max() - counts.min() <= 1                     # balanced before the noise
