"""jaxring: fast, hierarchical, compressed gradient reduction for data-parallel JAX.

Drop-ins for ``jax.lax`` collectives inside ``shard_map``/``pmap`` with algorithms ``xla``,
``ring``, ``hierarchical`` (BlueConnect) and ``auto``; codecs that keep the bandwidth-optimal ring.
"""
from jaxring import codecs as codecs
from jaxring._src.calibrate import calibrate as calibrate
from jaxring._src.collectives import all_gather as all_gather
from jaxring._src.collectives import pmean as pmean
from jaxring._src.collectives import psum as psum
from jaxring._src.collectives import psum_scatter as psum_scatter
from jaxring._src.error_feedback import reduce_gradients as reduce_gradients
from jaxring._src.optim.adam import CompressedAdamState as CompressedAdamState
from jaxring._src.optim.adam import compressed_adam as compressed_adam
from jaxring._src.optim.compose import compressed_optimizer as compressed_optimizer
from jaxring._src.optim.diloco import DiLoCoState as DiLoCoState
from jaxring._src.optim.diloco import diloco as diloco
from jaxring._src.optim.momentum import MomentumCorrectionState as MomentumCorrectionState
from jaxring._src.optim.momentum import momentum_correction as momentum_correction
from jaxring._src.topology import Level as Level
from jaxring._src.topology import Topology as Topology
from jaxring._src.topology import default_topology as default_topology
from jaxring._src.topology import set_default_topology as set_default_topology
from jaxring._src.topology import use_topology as use_topology

__version__ = "0.1.0"

import importlib as _importlib

from jaxring._src.train.grad import grad as grad
from jaxring._src.train.grad import value_and_grad as value_and_grad
from jaxring._src.train.state import TrainState as TrainState
from jaxring._src.train.decorator import train_step as train_step

# Submodules with heavier imports (MPI, the input pipeline, benchmarks) load on first attribute
# access, so that `import jaxring as jr; jr.distributed.initialize()` works as written.
_LAZY_SUBMODULES = ("bench", "data", "distributed", "train")


def __getattr__(name: str):
  if name in _LAZY_SUBMODULES:
    return _importlib.import_module(f"jaxring.{name}")
  raise AttributeError(f"module 'jaxring' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_LAZY_SUBMODULES))
