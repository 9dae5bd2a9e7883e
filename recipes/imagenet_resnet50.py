"""ResNet-50 v1.5 on ImageNet: 90 epochs, ~76.5% top-1 expected (He et al. 2019's recipe).

SGD with Nesterov momentum 0.9, learning rate 0.1 x batch/256 with 5 warm-up epochs and cosine
decay, label smoothing 0.1, weight decay 1e-4 on kernels only, bf16 compute with f32 parameters,
top-1/top-5 on the 50,000 validation images after every epoch, a checkpoint every 1000 steps.

Data: ``data_dir`` in the ImageNet layout (``train/<wnid>/*.JPEG``, ``val/<wnid>/*.JPEG``). Every
process reads its share of each global batch; ``batch_size`` is global.

Launch:

  # one host, all its GPUs
  python -m recipes.imagenet_resnet50 --config.data_dir=/data/imagenet --config.workdir=/ckpt/r50

  # 8 processes under MPI (one per GPU, or per CPU host); int8 on the wire
  mpirun -n 8 python -m recipes.imagenet_resnet50 --config.data_dir=/data/imagenet \\
      --config.workdir=/ckpt/r50 --config.compression=int8

  # two-level network (nodes x local devices): BlueConnect, int8 only between nodes
  mpirun -n 32 -ppn 8 python -m recipes.imagenet_resnet50 --config.mesh=hierarchical \\
      --config.algorithm=hierarchical --config.compression=int8 --config.data_dir=...

  # large batch: LARS (the peak learning rate is then given directly, not per 256 images)
  mpirun -n 64 python -m recipes.imagenet_resnet50 --config.batch_size=16384 \\
      --config.optimizer=lars --config.lr_scaling=none --config.learning_rate=12 \\
      --config.warmup_epochs=16 --config.data_dir=...

  # training images decoded on the GPU by NVIDIA DALI (pip install 'jaxring[dali]')
  python -m recipes.imagenet_resnet50 --config.data_dir=/data/imagenet --config.data_backend=dali

  # no data at hand: synthetic images (throughput only)
  python -m recipes.imagenet_resnet50 --config.dataset=synthetic --config.num_steps=200

  # flax.linen.BatchNorm instead of the fused BatchNorm + ReLU of recipes/batchnorm.py (same
  # parameters and checkpoints; the fused one is 4-5% faster on an H100, docs/benchmarks.md)
  python -m recipes.imagenet_resnet50 --config.dataset=synthetic --config.norm=flax

The same through the CLI: ``jaxring train imagenet_resnet50 --config.data_dir=...``. A job that
finds checkpoints in ``workdir`` resumes from the newest (state and data position).
"""
from __future__ import annotations

import sys

from recipes.config import Config


def get_config() -> Config:
  return Config(
      depth=50, width=64, stem="imagenet", dtype="bfloat16",
      dataset="folder", num_classes=1000, image_size=224,
      batch_size=1024, eval_batch_size=1024, num_epochs=90.0,
      optimizer="sgd", learning_rate=0.1, lr_scaling="linear", warmup_epochs=5.0,
      momentum=0.9, nesterov=True, weight_decay=1e-4, label_smoothing=0.1,
      compression="none", algorithm="auto", bucket_mib=25.0,
      log_every=100, eval_every_epochs=1.0, checkpoint_every=1000)


def main(argv=None) -> int:
  from recipes import train
  train.run(get_config(), argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
