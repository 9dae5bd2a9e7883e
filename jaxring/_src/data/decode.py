"""The fast decode of one example: libjpeg-turbo (``simplejpeg``) + OpenCV, into a batch's slot.

Per image, for the 224 px transforms of ImageNet-sized JPEGs (shorter side 375), single-threaded
on the 2-core development machine (``jaxring bench data --stages``; docs/benchmarks.md, "Input
pipeline"):

- libjpeg-turbo through ``simplejpeg`` decodes in 0.87 ms against 0.97 ms through PIL; Huffman
  decoding is most of it, so reduced-size decoding saves less than its pixel count suggests
  (1/2: 0.74 ms, 1/8: 0.59 ms), and libjpeg's other scales (3/8..7/8) are SLOWER than the
  full decode (6/8: 1.07 ms, 7/8: 1.29 ms). Only 1/2, 1/4, 1/8 are used.
- PIL's antialiased bilinear resize of the crop costs 0.84 ms, OpenCV's bilinear 0.14 ms and its
  area resampling 0.69 ms, written straight into the batch's slot (``dst=``).

So: read the header, draw the crop box from it (the same boxes and the same draws as
:func:`jaxring.data.load_image`), decode at the smallest 1/2^k scale that keeps at least
``image_size`` pixels across the crop in both directions, and resample the crop once into the
output slot: bilinear, which reads every source pixel where less than 2x is left to shrink (the
DCT scaling took the rest), and area resampling where more is left (at very small sizes). The
horizontal flip is OpenCV's, from a per-worker scratch image.

Anything libjpeg-turbo does not read cleanly goes through PIL instead (:func:`load_image`): CMYK and
YCCK JPEGs (PIL applies Adobe's inverted-CMYK convention), PNG or other bytes behind a ``.JPEG``
name, and JPEGs with recoverable errors, which PIL decodes where they are only warnings and
rejects where data is missing (a truncated file). Which path an image takes depends only on its
bytes, and both draw the crop from the same generator, so batches stay a function of the seed.
"""
from __future__ import annotations

import logging
import os

import numpy as np

from jaxring._src.data.transforms import (CorruptImageError, center_crop_box, load_image,
                                          pil_image, random_resized_crop_box)
from jaxring._src.extras import require

_NEEDS = "jaxring.data's JPEG decoder needs simplejpeg and OpenCV"
try:
  cv2 = require("cv2", "data", _NEEDS)
  simplejpeg = require("simplejpeg", "data", _NEEDS)
except ImportError as _e:  # the PIL path still works; ImageLoader says which decoder it uses
  cv2 = simplejpeg = None
  _IMPORT_ERROR: ImportError | None = _e
else:
  _IMPORT_ERROR = None

DECODERS = ("auto", "turbo", "pil")
_warned: list = []  # the fallback to Pillow is announced once per process
_JPEG_SOI = b"\xff\xd8"
_SCALES = (8, 4, 2, 1)  # denominators of the libjpeg scales worth using, largest first


def fast_decoder_error() -> str | None:
  """None when the libjpeg-turbo path can run, else why not (the missing package, and the extra
  that installs it)."""
  return None if _IMPORT_ERROR is None else str(_IMPORT_ERROR)


def resolve_decoder(decoder: str) -> str:
  """``"auto"`` -> ``"turbo"`` where simplejpeg and OpenCV import, else ``"pil"``.

  Raises:
    ValueError: an unknown name.
    ImportError: Pillow is missing (every decoder falls back to it), or ``"turbo"`` is asked for
      where simplejpeg or OpenCV is missing (the message names the extra, ``jaxring[data]``).

  Example:
    >>> resolve_decoder("auto")
    'turbo'
  """
  if decoder not in DECODERS:
    raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
  pil_image()  # every decoder needs Pillow: the fast one hands it what libjpeg-turbo cannot read
  error = fast_decoder_error()
  if decoder == "turbo" and error:
    raise ImportError(error)
  if decoder == "auto":
    if error and not _warned:
      _warned.append(True)
      logging.getLogger(__name__).warning(
          "jaxring.data decodes with Pillow, about 1.8x the CPU time per image: %s", error)
    return "pil" if error else "turbo"
  return decoder


def dct_scale(box: tuple, image_size: int) -> int:
  """The largest ``s`` in (8, 4, 2, 1) such that decoding at 1/s keeps ``>= image_size`` pixels
  across the crop ``box`` (``(x, y, w, h)`` in full-size pixels) in both directions.

  libjpeg's scaled size is ``ceil(size / s)``, so the crop spans at least ``w / s`` of them.

  Example:
    >>> dct_scale((0, 0, 500, 375), 64)
    4
  """
  w, h = box[2], box[3]
  for s in _SCALES:
    if w / s >= image_size and h / s >= image_size:
      return s
  return 1


class TurboDecoder:
  """Decodes examples into batch slots; one per worker (it owns scratch buffers).

  Args:
    image_size: the output's height and width.

  Example:
    >>> dec = TurboDecoder(224)
    >>> out = np.empty((224, 224, 3), np.uint8)
    >>> dec.decode_into(out, "train/n01440764/n01440764_10026.JPEG", train=False)
  """

  def __init__(self, image_size: int):
    if fast_decoder_error():
      raise ImportError(fast_decoder_error())
    self.image_size = image_size
    self._pixels = np.empty(0, np.uint8)
    self._flip = np.empty((image_size, image_size, 3), np.uint8)
    self._max_pixels = pil_image().MAX_IMAGE_PIXELS or 1 << 62

  def decode_into(self, out: np.ndarray, path: str, *, train: bool,
                  seed: tuple | None = None) -> None:
    """Writes the transformed image of ``path`` into ``out`` (``[S, S, 3]`` uint8, contiguous).

    Args:
      out: the destination slot.
      path: the image file.
      train: random-resized crop + flip drawn from ``np.random.default_rng(seed)``; else the eval
        transform.
      seed: the example's seed (train only).

    Raises:
      CorruptImageError: neither libjpeg-turbo nor PIL can decode it (names the file).
    """
    try:
      with open(path, "rb") as f:
        data = f.read()
    except OSError as e:
      raise CorruptImageError(f"cannot read image {path}: {e}") from e
    if data[:2] == _JPEG_SOI and self._decode_jpeg(out, data, train, seed):
      return
    rng = np.random.default_rng(seed) if train else None
    out[...] = load_image(path, self.image_size, train=train, rng=rng)

  def _decode_jpeg(self, out: np.ndarray, data: bytes, train: bool, seed) -> bool:
    """The fast path; False where PIL must decode the file instead."""
    try:
      height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
      return False
    if colorspace in ("CMYK", "YCCK") or not 0 < width * height <= self._max_pixels:
      return False  # PIL: Adobe's CMYK convention; a decompression bomb is refused there
    if train:
      rng = np.random.default_rng(seed)
      box = random_resized_crop_box(width, height, rng)
      flip = rng.random() < 0.5
    else:
      box = center_crop_box(width, height, self.image_size)
      flip = False
    s = dct_scale(box, self.image_size)
    scaled_h, scaled_w = -(-height // s), -(-width // s)
    need = scaled_h * scaled_w * 3
    if self._pixels.size < need:
      self._pixels = np.empty(need, np.uint8)
    try:
      pixels = simplejpeg.decode_jpeg(data, "RGB", min_height=scaled_h, min_width=scaled_w,
                                      buffer=self._pixels)
    except ValueError:  # truncated, or a libjpeg warning: PIL decides
      return False
    sy, sx = pixels.shape[0] / height, pixels.shape[1] / width
    x, y, w, h = box
    x0, y0 = int(round(x * sx)), int(round(y * sy))
    x1 = min(pixels.shape[1], max(x0 + 1, int(round((x + w) * sx))))
    y1 = min(pixels.shape[0], max(y0 + 1, int(round((y + h) * sy))))
    crop = pixels[y0:y1, x0:x1]
    # the DCT scaling left less than 2x to shrink, where bilinear samples every source pixel;
    # area resampling (5x bilinear's cost at 328 -> 224) only where more is left
    shrinks_2x = max(crop.shape[0], crop.shape[1]) >= 2 * self.image_size
    dst = self._flip if flip else out
    cv2.resize(crop, (self.image_size, self.image_size), dst=dst,
               interpolation=cv2.INTER_AREA if shrinks_2x else cv2.INTER_LINEAR)
    if flip:
      cv2.flip(self._flip, 1, dst=out)
    return True


class PilDecoder:
  """The PIL path for every file (:func:`jaxring.data.load_image`), same interface as
  :class:`TurboDecoder`."""

  def __init__(self, image_size: int):
    self.image_size = image_size

  def decode_into(self, out: np.ndarray, path: str, *, train: bool,
                  seed: tuple | None = None) -> None:
    rng = np.random.default_rng(seed) if train else None
    out[...] = load_image(path, self.image_size, train=train, rng=rng)


def make_decoder(decoder: str, image_size: int) -> TurboDecoder | PilDecoder:
  """The decoder object for ``decoder`` (a name of :data:`DECODERS`, resolved)."""
  if resolve_decoder(decoder) == "turbo":
    return TurboDecoder(image_size)
  return PilDecoder(image_size)


def limit_library_threads() -> None:
  """One thread inside OpenCV: the loader's workers are the parallelism (a worker that fans out
  over all cores fights the others for them)."""
  if cv2 is not None:
    cv2.setNumThreads(1)
  os.environ.setdefault("OMP_NUM_THREADS", "1")

