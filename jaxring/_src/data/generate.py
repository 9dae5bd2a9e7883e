"""``write_image_folder``: a small, learnable data set of real JPEG files in the ImageNet layout.

Class ``c`` draws one object whose kind is given by four class attributes, mixed-radix digits of
``c``: its hue (``c mod H``, ``H = min(num_classes, 12)`` evenly spaced hues, so with up to 12
classes the hue alone tells the class), its shape (disc, square, triangle, ring), the angle of
the stripes that texture it (6 angles) and their period (3), then stripes or checks; each later
digit is offset by the hue's, so neighbouring classes differ in several attributes. Around that
fixed part everything varies per image: position, size, rotation, saturation and brightness, a
low-saturation blotchy background, a small distractor disc of a random hue, pixel noise, and
the image's size and aspect ratio. A single pixel does not tell the class, but a small CNN at
32–64 px learns it in a few hundred steps; it is data for tests and demos that needs no download.
"""
from __future__ import annotations

import colorsys
import math
import os
import pathlib

import numpy as np

from jaxring._src.data.transforms import pil_image

_SHAPES = ("disc", "square", "triangle", "ring")
_ANGLES = 6
_PERIODS = (0.07, 0.11, 0.17)  # stripe period as a fraction of the shorter side
_TEXTURES = ("stripes", "checks")


def num_hues(num_classes: int) -> int:
  return min(num_classes, 12)


def class_pattern(c: int, num_classes: int) -> dict:
  """The attributes that class ``c`` fixes (see the module docstring).

  Example:
    >>> class_pattern(3, 10)
    {'hue': 0.3, 'shape': 'ring', 'angle': 1.5707963267948966, 'period': 0.07, 'texture': 'checks'}
  """
  hues = num_hues(num_classes)
  radices = (hues, len(_SHAPES), _ANGLES, len(_PERIODS), len(_TEXTURES))
  digits = []
  for radix in radices:
    digits.append(c % radix)
    c //= radix
  # offset each later digit by the hue digit (a bijection for a fixed hue), so that classes that
  # share all higher digits still differ in shape, stripes and period, not in hue alone
  digits = [digits[0]] + [(d + digits[0]) % r for d, r in zip(digits[1:], radices[1:])]
  return {"hue": digits[0] / hues, "shape": _SHAPES[digits[1]],
          "angle": digits[2] * math.pi / _ANGLES, "period": _PERIODS[digits[3]],
          "texture": _TEXTURES[digits[4]]}


def max_classes(num_classes: int) -> int:
  return num_hues(num_classes) * len(_SHAPES) * _ANGLES * len(_PERIODS) * len(_TEXTURES)


def _shape_mask(shape: str, u: np.ndarray, v: np.ndarray, r: float) -> np.ndarray:
  if shape == "disc":
    return u * u + v * v < r * r
  if shape == "square":
    return (np.abs(u) < 0.85 * r) & (np.abs(v) < 0.85 * r)
  if shape == "triangle":  # apex at v = -r, base at v = r/2
    return (v < 0.5 * r) & (np.abs(u) < (v + r) * math.tan(math.pi / 6))
  d2 = u * u + v * v
  return (d2 < r * r) & (d2 > (0.55 * r) ** 2)  # ring


def _rgb(hue: float, saturation: float, value: float) -> np.ndarray:
  return np.array(colorsys.hsv_to_rgb(hue % 1.0, saturation, value)) * 255.0


def render_example(c: int, num_classes: int, image_size: int,
                   rng: np.random.Generator) -> np.ndarray:
  """One ``[height, width, 3]`` uint8 image of class ``c``; the shorter side is ``image_size``."""
  Image = pil_image()
  pattern = class_pattern(c, num_classes)
  short, long_ = image_size, int(round(image_size * rng.uniform(1.0, 1.4)))
  height, width = (short, long_) if rng.random() < 0.7 else (long_, short)
  yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
  grid = rng.uniform(40, 215, size=(4, 4, 1)) + rng.normal(0, 12, size=(4, 4, 3))
  background = Image.fromarray(np.clip(grid, 0, 255).astype(np.uint8)).resize(
      (width, height), Image.Resampling.BILINEAR)
  image = np.asarray(background, np.float32).copy()

  r = short * rng.uniform(0.2, 0.34)
  cx, cy = width * rng.uniform(0.35, 0.65), height * rng.uniform(0.35, 0.65)
  theta = rng.uniform(0, 2 * math.pi)
  u = (xx - cx) * math.cos(theta) + (yy - cy) * math.sin(theta)
  v = -(xx - cx) * math.sin(theta) + (yy - cy) * math.cos(theta)
  inside = _shape_mask(pattern["shape"], u, v, r)
  angle = pattern["angle"] + rng.normal(0, 0.08)
  period = short * pattern["period"] * rng.uniform(0.85, 1.15)
  phase = rng.uniform(0, 2 * math.pi)
  along = 2 * math.pi * (xx * math.cos(angle) + yy * math.sin(angle)) / period + phase
  wave = np.sin(along)
  if pattern["texture"] == "checks":
    across = 2 * math.pi * (-xx * math.sin(angle) + yy * math.cos(angle)) / period
    wave = wave * np.sin(across)
  texture = np.where(wave > 0, 1.0, 0.5).astype(np.float32)
  colour = _rgb(pattern["hue"] + rng.normal(0, 0.008), rng.uniform(0.75, 1.0),
                rng.uniform(0.8, 1.0))
  image[inside] = colour * texture[inside, None]

  dr = short * rng.uniform(0.06, 0.1)
  dx, dy = rng.uniform(dr, width - dr), rng.uniform(dr, height - dr)
  distractor = (xx - dx) ** 2 + (yy - dy) ** 2 < dr * dr
  image[distractor] = _rgb(rng.random(), 0.9, 0.9)
  image += rng.normal(0, 8, size=image.shape)
  return np.clip(image, 0, 255).astype(np.uint8)


def write_image_folder(root: str | os.PathLike, *, num_classes: int = 10,
                       train_per_class: int = 32, val_per_class: int = 8, image_size: int = 64,
                       seed: int = 0, val_layout: str = "folders", quality: int = 90) -> list[str]:
  """Writes a learnable ImageNet-layout data set of real JPEG files and returns its wnids.

  Writes ``root/train/<wnid>/<wnid>_<i>.JPEG`` and either ``root/val/<wnid>/*.JPEG``
  (``val_layout="folders"``) or ``root/val/ILSVRC2012_val_<k>.JPEG`` in a shuffled order plus
  ``root/val_labels.txt`` of ``filename wnid`` lines (``val_layout="flat"``). The wnids are
  ``n00000000``, ``n00000001``, ...; the content of class ``c`` is described in the module
  docstring (:func:`class_pattern`). Each image's shorter side is ``image_size``, its longer side
  up to 1.4 times that. The files are a pure function of the arguments.

  Example:
    >>> wnids = write_image_folder("/tmp/toy", num_classes=10, train_per_class=200)
    >>> ImageFolder("/tmp/toy", "train").num_classes
    10
  """
  if val_layout not in ("folders", "flat"):
    raise ValueError(f"val_layout must be 'folders' or 'flat', got {val_layout!r}")
  if not 1 <= num_classes <= max_classes(num_classes):
    raise ValueError(f"num_classes must be in [1, {max_classes(num_classes)}], got {num_classes}")
  Image = pil_image()
  root = pathlib.Path(root)
  wnids = [f"n{c:08d}" for c in range(num_classes)]

  def write(path: pathlib.Path, c: int, rng: np.random.Generator) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(render_example(c, num_classes, image_size, rng)).save(
        path, "JPEG", quality=quality)

  for c, wnid in enumerate(wnids):
    for i in range(train_per_class):
      write(root / "train" / wnid / f"{wnid}_{i}.JPEG", c, np.random.default_rng((seed, 0, c, i)))
  val = [(c, i) for c in range(num_classes) for i in range(val_per_class)]
  if val_layout == "flat":
    val = [val[k] for k in np.random.default_rng((seed, 2)).permutation(len(val))]
  (root / "val").mkdir(parents=True, exist_ok=True)
  lines = []
  for k, (c, i) in enumerate(val):
    name = f"ILSVRC2012_val_{k + 1:08d}.JPEG"
    folder = root / "val" / wnids[c] if val_layout == "folders" else root / "val"
    write(folder / name, c, np.random.default_rng((seed, 1, c, i)))
    lines.append(f"{name} {wnids[c]}\n")
  if val_layout == "flat":
    (root / "val_labels.txt").write_text("".join(lines))
  return wnids
