"""Data-parallel training: ``@train_step``, reduced ``value_and_grad``, ``TrainState``, loop, checkpoints.

``jaxring.train_step``, ``jaxring.value_and_grad``, ``jaxring.grad`` and ``jaxring.TrainState`` are
the same objects, re-exported at the top level.
"""
from jaxring._src.train.buckets import Bucket as Bucket
from jaxring._src.train.checkpoint import (
    CheckpointCorruptError as CheckpointCorruptError,
)
from jaxring._src.train.checkpoint import Checkpointer as Checkpointer
from jaxring._src.train.data import BatchIterator as BatchIterator
from jaxring._src.train.functional import OptState as OptState
from jaxring._src.train.global_view import whole as whole
from jaxring._src.train.grad import full_params as full_params
from jaxring._src.train.grad import grad as grad
from jaxring._src.train.grad import value_and_grad as value_and_grad
from jaxring._src.train.loop import FitSummary as FitSummary
from jaxring._src.train.loop import fit as fit
from jaxring._src.train.metrics import JsonlWriter as JsonlWriter
from jaxring._src.train.metrics import Progress as Progress
from jaxring._src.train.precision import DynamicLossScale as DynamicLossScale
from jaxring._src.train.precision import Policy as Policy
from jaxring._src.train.sharding import default_mesh as default_mesh
from jaxring._src.train.state import TrainState as TrainState
from jaxring._src.train.step import TrainStep as TrainStep
from jaxring._src.train.decorator import train_step as train_step
