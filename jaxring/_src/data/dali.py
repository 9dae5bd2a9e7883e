"""``DaliImageLoader``: training batches decoded on the GPU by NVIDIA DALI (optional).

DALI (``pip install 'jaxring[dali]'``, i.e. ``nvidia-dali-cuda130``; ``nvidia-dali-cuda120`` for
CUDA 12) decodes JPEGs with nvJPEG on the GPU and hands the batch to JAX on the device. It is the
field's way to feed ResNet-50 at thousands of images/s per accelerator when the host has too few
cores for :class:`jaxring.data.ImageLoader`.

What it keeps of ``ImageLoader``'s contract, and what it does not:

- the same batches as a dict ``{"image": uint8 [B, S, S, 3], "label": int32 [B]}`` (B the
  per-process share of the global batch), ``batches_per_epoch``, ``get_state``/``set_state``;
- deterministic per seed: epoch ``e`` is a pipeline seeded from ``(seed, e)``, and resuming at
  ``(epoch, index)`` rebuilds that epoch's pipeline and runs it forward ``index`` batches (GPU
  time, not host time);
- NOT the same images as the CPU loader for the same seed: DALI's reader shards the file list into
  contiguous parts per process and shuffles each part with its own generator, and its crops come
  from its own random ops;
- training only: evaluation reads the validation set with ``ImageLoader`` (50,000 images, once
  per epoch);
- corrupt files: nvJPEG falls back to the CPU for what it cannot decode, but a file nothing can
  decode stops the pipeline (DALI has no skip), so ``corrupt_count`` is always 0.

This file is exercised only where DALI and a GPU are present; everywhere else the loader raises
at construction, naming the missing package.
"""
from __future__ import annotations

import importlib.util
from typing import Iterator

import jax
import numpy as np

from jaxring._src.extras import install_hint

DALI_PACKAGE = "nvidia-dali-cuda130"


def dali_error() -> str | None:
  """None where NVIDIA DALI and its JAX plugin can be imported, else why not."""
  if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
    return (f"the DALI input pipeline needs NVIDIA DALI, which is not installed: "
            f"{install_hint('dali')} (or {DALI_PACKAGE}; nvidia-dali-cuda120 for CUDA 12)")
  if not any(d.platform == "gpu" for d in jax.devices()):
    return "the DALI input pipeline needs a GPU visible to JAX; this process sees none"
  return None


class DaliImageLoader:
  """Endless training batches of an :class:`ImageFolder`, decoded and augmented on the GPU.

  Args:
    dataset: the images and labels (JPEG files).
    global_batch_size: the batch size over all processes.
    image_size: the height and width of the images.
    seed: the seed of the shuffling and of the augmentation.
    process_index, process_count: this process's shard (default: JAX's).
    num_threads: DALI's CPU threads (file reading, the few images nvJPEG hands back to the CPU).
    device_id: the CUDA device (default: this process's first local JAX device).

  Raises:
    ImportError: DALI or a GPU is missing (the message says which, and what to install).

  Example:
    >>> loader = DaliImageLoader(ImageFolder("/data/imagenet", "train"), 1024, seed=0)
    >>> next(loader)["image"].shape  # on the GPU, one process
    (1024, 224, 224, 3)
  """

  def __init__(self, dataset, global_batch_size: int, *, image_size: int = 224, seed: int = 0,
               process_index: int | None = None, process_count: int | None = None,
               num_threads: int = 4, device_id: int | None = None):
    error = dali_error()
    if error:
      raise ImportError(error)
    self.process_count = jax.process_count() if process_count is None else int(process_count)
    self.process_index = jax.process_index() if process_index is None else int(process_index)
    if global_batch_size <= 0 or global_batch_size % self.process_count:
      raise ValueError(f"global_batch_size {global_batch_size} is not a positive multiple of "
                       f"{self.process_count} processes")
    self.dataset, self.image_size, self.seed = dataset, image_size, seed
    self.batch_size = global_batch_size // self.process_count
    self.batches_per_epoch = len(dataset) // global_batch_size
    self.num_threads = num_threads
    self.device_id = jax.local_devices()[0].local_hardware_id if device_id is None else device_id
    self.corrupt_count = 0
    self.epoch, self.index = 0, 0
    self._iterator = None

  @property
  def num_classes(self) -> int:
    return self.dataset.num_classes

  def _build(self, epoch: int):
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.jax import DALIGenericIterator

    @pipeline_def(batch_size=self.batch_size, num_threads=self.num_threads,
                  device_id=self.device_id, seed=int(np.random.SeedSequence(
                      (self.seed, epoch)).generate_state(1)[0] & 0x7FFFFFFF))
    def pipeline():
      jpegs, labels = fn.readers.file(
          files=list(self.dataset.paths), labels=[int(x) for x in self.dataset.labels],
          shard_id=self.process_index, num_shards=self.process_count, random_shuffle=True,
          name="reader")
      images = fn.decoders.image_random_crop(
          jpegs, device="mixed", output_type=types.RGB, random_area=[0.08, 1.0],
          random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10)
      images = fn.resize(images, resize_x=self.image_size, resize_y=self.image_size)
      images = fn.flip(images, horizontal=fn.random.coin_flip(probability=0.5))
      return images, labels

    pipe = pipeline()
    pipe.build()
    return DALIGenericIterator([pipe], ["image", "label"], reader_name="reader")

  def __iter__(self) -> Iterator[dict]:
    return self

  def __next__(self) -> dict:
    if self._iterator is None:
      self._iterator = self._build(self.epoch)
      for _ in range(self.index):
        next(self._iterator)
    batch = next(self._iterator)
    self.index += 1
    if self.index >= self.batches_per_epoch:
      self.epoch, self.index, self._iterator = self.epoch + 1, 0, None
    return {"image": batch["image"], "label": batch["label"].reshape(-1).astype(np.int32)}

  def get_state(self) -> dict:
    return {"epoch": int(self.epoch), "index": int(self.index), "seed": int(self.seed)}

  def set_state(self, state: dict) -> None:
    if int(state.get("seed", self.seed)) != self.seed:
      raise ValueError(f"DaliImageLoader: the saved position is for seed {state['seed']}, this "
                       f"loader has seed {self.seed}")
    self.epoch, self.index, self._iterator = int(state["epoch"]), int(state["index"]), None

  def close(self) -> None:
    self._iterator = None


BACKENDS = ("cpu", "dali", "auto")


def make_train_loader(dataset, global_batch_size: int, *, backend: str = "cpu", **kwargs):
  """The training loader of ``backend``: ``"cpu"`` (:class:`ImageLoader`), ``"dali"``
  (:class:`DaliImageLoader`; raises where DALI or a GPU is missing), or ``"auto"`` (DALI where
  it can run, else the CPU loader).

  ``kwargs`` are :class:`ImageLoader`'s; those DALI has no use for (``num_workers``, ``decoder``,
  ``worker_type``, ``prefetch``, ``on_corrupt``) are dropped for it.

  Example:
    >>> loader = make_train_loader(ImageFolder(root, "train"), 1024, backend="auto", seed=0)
  """
  from jaxring._src.data.loader import ImageLoader

  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "dali" or (backend == "auto" and dali_error() is None):
    keep = ("image_size", "seed", "process_index", "process_count")
    return DaliImageLoader(dataset, global_batch_size, **{k: v for k, v in kwargs.items()
                                                          if k in keep})
  return ImageLoader(dataset, global_batch_size, train=True, **kwargs)
