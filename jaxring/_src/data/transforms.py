"""Decoding and augmentation of one image: Inception-style random-resized crop + flip, or the
standard eval transform (resize the shorter side to ``image_size / 0.875``, center crop).

Each transform is a crop box in the source image's pixel coordinates followed by ONE resampling
(``PIL.Image.resize(box=...)``, antialiased bilinear) to ``image_size``; geometrically this is
"crop, then resize" (and for eval "resize, then center crop") without a second resampling pass.
The box is chosen from the header's size before any pixel is decoded, so that ``Image.draft``
can ask libjpeg to decode at 1/2, 1/4 or 1/8 scale (in the DCT domain) whenever the crop keeps
at least ``image_size`` pixels in each direction at that scale: at ``image_size=64`` most ImageNet
images decode 4–8x smaller, which is most of the decode time saved.
"""
from __future__ import annotations

import math

import numpy as np

from jaxring._src.extras import require

EVAL_CROP_FRACTION = 0.875


def pil_image():
  """``PIL.Image`` (Pillow, the ``data`` extra), or an ImportError naming ``jaxring[data]``."""
  return require("PIL.Image", "data", "jaxring.data's image decoding needs Pillow")


class CorruptImageError(ValueError):
  """An image file that cannot be decoded; the message names the file."""


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator,
                            scale: tuple[float, float] = (0.08, 1.0),
                            ratio: tuple[float, float] = (3 / 4, 4 / 3),
                            attempts: int = 10) -> tuple[int, int, int, int]:
  """The Inception crop ``(x, y, w, h)``: area fraction in ``scale``, aspect ratio in ``ratio``.

  Tries ``attempts`` random boxes; if none fits inside the image, falls back to the largest
  centered box whose aspect ratio is clipped into ``ratio`` (as torchvision does).

  Example:
    >>> random_resized_crop_box(500, 375, np.random.default_rng(0))
    (65, 166, 129, 171)
  """
  area = width * height
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(attempts):
    target_area = area * rng.uniform(scale[0], scale[1])
    aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
    w = int(round(math.sqrt(target_area * aspect)))
    h = int(round(math.sqrt(target_area / aspect)))
    if 0 < w <= width and 0 < h <= height:
      x = int(rng.integers(0, width - w + 1))
      y = int(rng.integers(0, height - h + 1))
      return x, y, w, h
  aspect = width / height
  if aspect < ratio[0]:
    w, h = width, int(round(width / ratio[0]))
  elif aspect > ratio[1]:
    w, h = int(round(height * ratio[1])), height
  else:
    w, h = width, height
  return (width - w) // 2, (height - h) // 2, w, h


def center_crop_box(width: int, height: int, image_size: int,
                    crop_fraction: float = EVAL_CROP_FRACTION) -> tuple[float, float, float, float]:
  """The box that "resize the shorter side to ``image_size / crop_fraction``, then center crop
  ``image_size``" keeps, in source coordinates: a centered square of side
  ``crop_fraction * min(width, height)``.

  Example:
    >>> center_crop_box(500, 375, 224)
    (85.9375, 23.4375, 328.125, 328.125)
  """
  del image_size  # the kept region does not depend on the output size
  side = crop_fraction * min(width, height)
  return (width - side) / 2, (height - side) / 2, side, side


def load_image(path: str, image_size: int, *, train: bool,
               rng: np.random.Generator | None = None) -> np.ndarray:
  """Decodes ``path`` and returns the augmented ``[image_size, image_size, 3]`` uint8 RGB image.

  Args:
    path: a JPEG or PNG file (any mode; converted to RGB).
    image_size: the output's height and width.
    train: random-resized crop + random horizontal flip (needs ``rng``); else the eval transform.
    rng: the example's generator; the crop and the flip are drawn from it in that order.

  Raises:
    CorruptImageError: the file cannot be decoded (names the file; the cause is chained).

  Example:
    >>> x = load_image("train/n01440764/n01440764_10026.JPEG", 224, train=False)
    >>> x.shape, x.dtype
    ((224, 224, 3), dtype('uint8'))
  """
  Image = pil_image()
  # what PIL raises for an unreadable, truncated or hostile image file
  decode_errors = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)
  try:
    image = Image.open(path)
  except decode_errors as e:
    raise CorruptImageError(f"cannot decode image {path}: {e}") from e
  with image:
    width, height = image.size
    if train:
      x, y, w, h = random_resized_crop_box(width, height, rng)
      flip = rng.random() < 0.5
    else:
      x, y, w, h = center_crop_box(width, height, image_size)
      flip = False
    try:
      # draft picks the largest DCT scale 1/s with size // s >= the requested size, so asking
      # for size * image_size / crop keeps >= image_size pixels across the crop (JPEG only).
      image.draft("RGB", (max(1, math.ceil(width * image_size / w)),
                          max(1, math.ceil(height * image_size / h))))
      sx, sy = image.size[0] / width, image.size[1] / height
      image.load()
      # grayscale and CMYK JPEGs (ImageNet has both), palette or RGBA PNGs
      pixels = image if image.mode == "RGB" else image.convert("RGB")
    except decode_errors as e:
      raise CorruptImageError(f"cannot decode image {path}: {e}") from e
    out = pixels.resize((image_size, image_size), Image.Resampling.BILINEAR,
                        box=(x * sx, y * sy, (x + w) * sx, (y + h) * sy))
  if flip:
    out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
  return np.asarray(out)
