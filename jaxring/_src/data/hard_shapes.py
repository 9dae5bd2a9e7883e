"""``hard_shapes``: a generated image task that a small CNN does *not* saturate.

The demo's generated set (jaxring._src.data.generate) is learned to 99.6%, so a 1-point loss of
accuracy from gradient compression cannot be seen on it. Here the class is only in the geometry:
one of 4 shapes (disc, square, triangle, ring) times one of 4 stripe orientations, 16 classes,
while everything that would make it easy is random per image: the object's hue and the
background's, its position, size and brightness, stripe period and phase, an occluding
rectangle of random colour that may hide part of the object, and pixel noise. A fraction
of the training labels is replaced by a uniformly random class (``label_noise``); test labels are
clean. Small images (16 px) keep it fast on a CPU: arrays in memory, no files.

A plain small CNN reaches roughly 75-90% test accuracy in a few hundred steps (measured figures in
docs/benchmarks.md, "Convergence with compression"), so a 1-point gap is visible.
"""
from __future__ import annotations

import numpy as np

SHAPES = 4
ORIENTATIONS = 4
NUM_CLASSES = SHAPES * ORIENTATIONS


def _masks(kind: np.ndarray, u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
  """Per-image shape masks: ``kind`` [n] in 0..3, ``u, v`` [n, s, s] centred coordinates."""
  r = r[:, None, None]
  disc = u * u + v * v < r * r
  square = np.maximum(np.abs(u), np.abs(v)) < 0.85 * r
  triangle = (v < 0.8 * r) & (v > -0.9 * r + 1.8 * np.abs(u))
  ring = (u * u + v * v < r * r) & (u * u + v * v > 0.45 * r * r)
  k = kind[:, None, None]
  return np.where(k == 0, disc, np.where(k == 1, square, np.where(k == 2, triangle, ring)))


def _hsv_to_rgb(h, s, v) -> np.ndarray:
  i = np.floor(h * 6).astype(int) % 6
  f = h * 6 - np.floor(h * 6)
  p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
  table = np.stack([np.stack(c, -1) for c in
                    ((v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q))], 0)
  return table[i, np.arange(len(h))]


def render(labels: np.ndarray, image_size: int, rng: np.random.RandomState, *,
           occluders: int = 1, noise: float = 0.1) -> np.ndarray:
  """Images [n, size, size, 3] float32 in about [0, 1] for class ``labels`` [n]."""
  n, s = len(labels), image_size
  shape, orient = labels // ORIENTATIONS, labels % ORIENTATIONS
  yy, xx = np.meshgrid(np.arange(s) + 0.5, np.arange(s) + 0.5, indexing="ij")
  r = rng.uniform(0.3, 0.45, n) * s
  cx = rng.uniform(0.3, 0.7, n) * s
  cy = rng.uniform(0.3, 0.7, n) * s
  u, v = xx[None] - cx[:, None, None], yy[None] - cy[:, None, None]
  mask = _masks(shape, u, v, r)
  angle = orient * np.pi / ORIENTATIONS + rng.uniform(-0.15, 0.15, n)
  period = rng.uniform(0.22, 0.34, n) * s
  phase = rng.uniform(0, 2 * np.pi, n)
  proj = u * np.cos(angle)[:, None, None] + v * np.sin(angle)[:, None, None]
  stripes = np.sin(2 * np.pi * proj / period[:, None, None] + phase[:, None, None]) > 0
  fg = _hsv_to_rgb(rng.uniform(0, 1, n), rng.uniform(0.4, 1, n), rng.uniform(0.6, 1, n))
  bg = _hsv_to_rgb(rng.uniform(0, 1, n), rng.uniform(0, 0.6, n), rng.uniform(0.2, 0.8, n))
  dark = rng.uniform(0.1, 0.5, n)[:, None]
  obj = np.where(stripes[..., None], fg[:, None, None], (fg * dark)[:, None, None])
  img = np.where(mask[..., None], obj, bg[:, None, None])
  for _ in range(occluders):  # rectangles of a random colour, anywhere
    w, h = rng.uniform(0.1, 0.35, (2, n)) * s
    x0, y0 = rng.uniform(-0.1, 0.9, (2, n)) * s
    occ = ((xx[None] > x0[:, None, None]) & (xx[None] < (x0 + w)[:, None, None])
           & (yy[None] > y0[:, None, None]) & (yy[None] < (y0 + h)[:, None, None]))
    colour = rng.uniform(0, 1, (n, 3))
    img = np.where(occ[..., None], colour[:, None, None], img)
  img = img + rng.normal(0, noise, img.shape)
  return img.astype(np.float32)


def hard_shapes(num_train: int = 16384, num_test: int = 1024, image_size: int = 16,
                label_noise: float = 0.1, seed: int = 0):
  """``(x_train, y_train, x_test, y_test)``: images [n, s, s, 3] float32, labels int32 in 0..15.

  Args:
    num_train, num_test: examples per split (classes balanced over the two together).
    image_size: side in pixels.
    label_noise: fraction of training labels replaced by a uniformly random class.
    seed: everything is a function of it.

  Example:
    >>> x, y, xt, yt = hard_shapes(256, 64)
    >>> x.shape, int(y.max()) < 16
    ((256, 16, 16, 3), True)
  """
  rng = np.random.RandomState(seed)
  y = np.arange(num_train + num_test) % NUM_CLASSES
  rng.shuffle(y)
  x = render(y, image_size, rng)
  y_train = y[:num_train].copy()
  noisy = rng.uniform(size=num_train) < label_noise
  y_train[noisy] = rng.randint(0, NUM_CLASSES, int(noisy.sum()))
  return x[:num_train], y_train.astype(np.int32), x[num_train:], y[num_train:].astype(np.int32)
