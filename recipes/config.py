"""Recipe configs: one dataclass, overridden from the command line.

Every recipe file defines ``get_config() -> Config``; its ``main`` applies the command line with
:func:`override`, which takes both spellings::

  --config.batch_size=64   --config.batch_size 64   --batch-size 64   --batch_size=64

Values are parsed by the field's type (``true``/``false`` for booleans).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a recipe run reads. Steps are optimizer updates; the batch size is global."""

  # model
  depth: int = 50                    # ResNet v1.5 depth: 18, 34, 50, 101, 152
  width: int = 64                    # channels of the first stage
  stem: str = "imagenet"             # "imagenet" (7x7/2 + max-pool) or "cifar" (3x3/1)
  dtype: str = "bfloat16"            # compute dtype; parameters and statistics stay f32
  norm: str = "fused"                # BatchNorm: "fused" (two-pass gradient) or "flax"
  # data
  dataset: str = "folder"            # "folder" (ImageNet layout), "generated", "synthetic"
  data_dir: str = ""                 # root with train/ and val/ ("generated": written there)
  num_classes: int = 1000
  image_size: int = 224
  train_per_class: int = 500         # "generated" only
  val_per_class: int = 50            # "generated" only
  generated_image_size: int = 64     # "generated" only: stored JPEG size
  num_workers: int = 0               # decoding worker processes (0: one per CPU)
  data_backend: str = "cpu"          # training decode: "cpu", "dali" (GPU; jaxring[dali]), "auto"
  # optimization
  batch_size: int = 1024             # global, over all processes
  eval_batch_size: int = 1024
  num_epochs: float = 90.0
  num_steps: int = 0                 # > 0: overrides num_epochs
  optimizer: str = "sgd"             # "sgd" (Nesterov) or "lars"
  learning_rate: float = 0.1         # per 256 images with lr_scaling="linear"
  lr_scaling: str = "linear"         # "linear" (Goyal et al.) or "none"
  warmup_epochs: float = 5.0
  momentum: float = 0.9
  nesterov: bool = True
  weight_decay: float = 1e-4
  label_smoothing: float = 0.1
  lars_trust_coefficient: float = 0.001
  # gradient reduction
  compression: str = "none"          # jaxring.codecs.parse: "none", "bf16", "int8:256", "topk:0.01"
  algorithm: str = "auto"            # "auto", "xla", "ring", "hierarchical"
  mesh: str = "flat"                 # "flat": one axis "data"; "hierarchical": (node, local)
  bucket_mib: float = 25.0
  shard: str = "none"                # "none", "optimizer" (ZeRO-1/2), "params" (FSDP / ZeRO-3)
  param_compression: str = "none"    # shard="params": the parameters' all-gather codec
  hpz: bool = False                  # shard="params", mesh="hierarchical": regather in the node
  error_feedback: bool = True
  # bookkeeping
  workdir: str = ""                  # checkpoints and metrics.jsonl ("": none)
  seed: int = 0
  log_every: int = 100
  eval_every_epochs: float = 1.0     # 0: only at the end
  eval_steps: int = 0                # > 0: evaluate on that many batches only
  checkpoint_every: int = 1000       # steps (and always at the end)
  progress: bool = True
  cpu_devices: int = 0               # > 0: emulate that many CPU devices per process


def _parse(field: dataclasses.Field, text: str):
  kind = field.type if isinstance(field.type, str) else field.type.__name__
  if kind == "bool":
    if text.lower() in ("1", "true", "yes", "on"):
      return True
    if text.lower() in ("0", "false", "no", "off"):
      return False
    raise ValueError(f"--{field.name}: expected true/false, got {text!r}")
  return {"int": int, "float": float, "str": str}[kind](text)


def override(config, argv: Sequence[str]):
  """``config`` (a dataclass: :class:`Config` or another recipe's) with the ``--config.name=value``
  / ``--name value`` arguments in ``argv`` applied.

  Raises:
    ValueError: an unknown name, a missing value or a value of the wrong type.

  Example:
    >>> override(Config(), ["--config.batch_size=64", "--num-steps", "10"]).batch_size
    64
  """
  fields = {f.name: f for f in dataclasses.fields(config)}
  changes, args = {}, list(argv)
  while args:
    arg = args.pop(0)
    if not arg.startswith("--"):
      raise ValueError(f"unexpected argument {arg!r}; use --name=value or --config.name=value")
    name, eq, value = arg[2:].partition("=")
    name = name.removeprefix("config.").replace("-", "_")
    if name not in fields:
      raise ValueError(f"unknown config field {name!r}; fields: {', '.join(sorted(fields))}")
    if not eq:
      if fields[name].type in ("bool", bool) and (not args or args[0].startswith("--")):
        value = "true"
      elif not args:
        raise ValueError(f"--{name} needs a value")
      else:
        value = args.pop(0)
    changes[name] = _parse(fields[name], value)
  return dataclasses.replace(config, **changes)
