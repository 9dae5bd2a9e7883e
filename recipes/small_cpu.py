"""A ResNet-18-like network at 32x32 that trains on a CPU in a few minutes (``make demo``).

Width 16 (701k parameters), a 3x3 stem without max-pool, on a generated 10-class dataset in the
ImageNet layout (JPEGs written by :func:`jaxring.data.write_image_folder`, no download), 8 emulated
CPU devices, int8 gradients with error feedback. The optimizer is the ImageNet recipe's (Nesterov
SGD, linear scaling, warm-up, cosine decay, label smoothing, no decay on BatchNorm and biases),
with a higher rate per 256 images and more weight decay for a small dataset and a short run.

Launch:

  python -m recipes.small_cpu                                  # ~2 minutes on 2 cores
  python -m recipes.small_cpu --num-steps 50 --compression none
  python -m recipes.small_cpu --config.workdir=/tmp/small      # checkpoints, metrics.jsonl

  # 2 processes x 4 emulated devices on localhost
  mpirun -n 2 python -m recipes.small_cpu --cpu-devices 4
"""
from __future__ import annotations

import os
import sys

from recipes.config import Config


def default_data_dir() -> str:
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache, "jaxring", "generated-10")


def get_config() -> Config:
  return Config(
      depth=18, width=16, stem="cifar", dtype="float32",
      dataset="generated", data_dir=default_data_dir(), num_classes=10, image_size=32,
      train_per_class=300, val_per_class=50, generated_image_size=40,
      batch_size=128, eval_batch_size=256, num_epochs=0.0, num_steps=60,
      optimizer="sgd", learning_rate=0.4, lr_scaling="linear", warmup_epochs=0.5,
      momentum=0.9, nesterov=True, weight_decay=5e-4, label_smoothing=0.1,
      compression="int8", algorithm="auto", bucket_mib=25.0,
      log_every=10, eval_every_epochs=0.0, checkpoint_every=1000, cpu_devices=8)


def main(argv=None) -> int:
  from recipes import train
  train.run(get_config(), argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
