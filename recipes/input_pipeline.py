"""Batches for the recipes, from :mod:`jaxring.data`: an ImageNet folder, a generated one, or
synthetic images.

Loaders yield ``uint8`` images; :func:`normalize` turns them into floats *on the device*, inside
the step: a uint8 batch is a quarter of the bytes of an f32 one to copy to the device (ResNet-50 at
224 px reads ~150 KB per image per step, enough for host-to-device copies to matter on a GPU).

With several processes every loader yields this process's share of each global batch
(``jaxring.train_step`` assembles the global array).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from recipes.config import Config

MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)
_GENERATED_MARKER = "jaxring-generated.json"


def normalize(images: jax.Array) -> jax.Array:
  """uint8 ``[..., H, W, 3]`` RGB -> f32, standardized with the ImageNet channel mean and std.

  Example:
    >>> normalize(batch["image"]).dtype
    dtype('float32')
  """
  mean = jnp.asarray(MEAN_RGB, jnp.float32)
  std = jnp.asarray(STDDEV_RGB, jnp.float32)
  return (images.astype(jnp.float32) - mean) / std


def ensure_generated(config: Config) -> str:
  """Writes the generated ImageNet-layout dataset under ``config.data_dir`` unless it is there.

  Process 0 writes; the others wait at a barrier (the folder must be on a file system they share).
  A marker file records what was generated, so a second run with the same settings reuses it.
  """
  from jaxring.data import write_image_folder
  import jaxring.distributed

  if not config.data_dir:
    raise ValueError("dataset='generated' needs data_dir (where to write the images)")
  spec = {"num_classes": config.num_classes, "train_per_class": config.train_per_class,
          "val_per_class": config.val_per_class, "image_size": config.generated_image_size,
          "seed": config.seed}
  marker = os.path.join(config.data_dir, _GENERATED_MARKER)
  if jax.process_index() == 0 and not _marker_matches(marker, spec):
    os.makedirs(config.data_dir, exist_ok=True)
    write_image_folder(config.data_dir, **spec)
    with open(marker, "w") as f:
      json.dump(spec, f)
  jaxring.distributed.barrier("recipes-generated-data")
  return config.data_dir


def _marker_matches(path: str, spec: dict) -> bool:
  try:
    with open(path) as f:
      return json.load(f) == spec
  except (OSError, ValueError):
    return False


def train_batches(config: Config):
  """The endless training iterator and the number of steps in one epoch.

  Example:
    >>> batches, steps_per_epoch = train_batches(config)
    >>> batch = next(batches)  # {"image": uint8 [local, S, S, 3], "label": int32 [local]}
  """
  from jaxring.data import ImageFolder, SyntheticImages, make_train_loader

  if config.dataset == "synthetic":
    batches = SyntheticImages(config.batch_size, image_size=config.image_size,
                              num_classes=config.num_classes, seed=config.seed)
    return batches, batches.batches_per_epoch  # an "epoch" of ImageNet's size
  root = ensure_generated(config) if config.dataset == "generated" else _folder(config)
  ds = ImageFolder(root, split="train", num_classes=config.num_classes)
  # data_backend="dali" raises, naming the package, where DALI or a GPU is missing; "auto"
  # takes the CPU loader there
  loader = make_train_loader(ds, config.batch_size, backend=config.data_backend,
                             image_size=config.image_size, seed=config.seed,
                             num_workers=config.num_workers or None)
  return loader, loader.batches_per_epoch


def eval_batches(config: Config):
  """The validation loader (one pass = ``batches_per_epoch`` batches, the last one padded and
  carrying a ``"mask"``), or for synthetic data an iterator of synthetic batches. Evaluation
  always decodes on the CPU, whatever ``data_backend`` trains with."""
  from jaxring.data import ImageFolder, ImageLoader, SyntheticImages

  if config.dataset == "synthetic":
    return SyntheticImages(config.eval_batch_size, image_size=config.image_size,
                           num_classes=config.num_classes, seed=config.seed + 1)
  root = config.data_dir if config.dataset == "generated" else _folder(config)
  ds = ImageFolder(root, split="val", num_classes=config.num_classes)
  return ImageLoader(ds, config.eval_batch_size, train=False, image_size=config.image_size,
                     seed=config.seed, num_workers=config.num_workers or None,
                     drop_remainder=False)


def _folder(config: Config) -> str:
  if config.dataset != "folder":
    raise ValueError(f"dataset must be 'folder', 'generated' or 'synthetic', got "
                     f"{config.dataset!r}")
  if not config.data_dir or not os.path.isdir(os.path.join(config.data_dir, "train")):
    raise FileNotFoundError(f"data_dir {config.data_dir!r} has no train/ folder (ImageNet layout: "
                            "train/<wnid>/*.JPEG, val/<wnid>/*.JPEG)")
  return config.data_dir
