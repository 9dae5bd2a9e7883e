"""Data-parallel training: ``@train_step``, reduced ``value_and_grad``, ``TrainState``, loop, checkpoints.

``jaxring.train_step``, ``jaxring.value_and_grad``, ``jaxring.grad`` and ``jaxring.TrainState`` are
the same objects, re-exported at the top level.
"""
from jaxring.train.buckets import Bucket as Bucket
from jaxring.train.checkpoint import CheckpointCorruptError as CheckpointCorruptError
from jaxring.train.checkpoint import Checkpointer as Checkpointer
from jaxring.train.data import BatchIterator as BatchIterator
from jaxring.train.grad import grad as grad
from jaxring.train.grad import value_and_grad as value_and_grad
from jaxring.train.loop import fit as fit
from jaxring.train.metrics import JsonlWriter as JsonlWriter
from jaxring.train.metrics import Progress as Progress
from jaxring.train.precision import DynamicLossScale as DynamicLossScale
from jaxring.train.precision import Policy as Policy
from jaxring.train.state import TrainState as TrainState
from jaxring.train.step import TrainStep as TrainStep
from jaxring.train.step import default_mesh as default_mesh
from jaxring.train.step import train_step as train_step
