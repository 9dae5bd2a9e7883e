"""One data-parallel training step on ``gpus`` GPUs: backward, buckets, reductions, overlap.

Gradients become ready layer by layer in backward order; they fill buckets of ``bucket_bytes``;
a bucket's reduction starts when its last gradient is ready and the network is free (one
reduction at a time, in order: a lazy all-reduce). The step ends when backward and the last
reduction have both ended. Reduction times are the alpha-beta formulas of
``jaxring._src.cost_model``, with the node level's wire bytes scaled by the codec's ratio and
its encode/decode at the cluster's codec rate.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxring._src import cost_model
from jaxring._src.tools.simulate.cluster import Cluster
from jaxring._src.tools.simulate.model import Layer
from jaxring._src.topology import Level


@dataclasses.dataclass(frozen=True)
class Plan:
  algorithm: str = "hierarchical"   # "flat" (one ring over every GPU: the native all-reduce)
  wire_ratio: float = 1.0           # node-level wire bytes / f32 bytes (the codec's)
  codec: str = "none"


def shape(gpus: int, cluster: Cluster) -> tuple[int, int]:
  """(GPUs per node, nodes) of ``gpus`` GPUs of ``cluster``."""
  return min(gpus, cluster.gpus_per_node), max(1, gpus // cluster.gpus_per_node)


def all_reduce_seconds(nbytes: float, gpus: int, cluster: Cluster, plan: Plan) -> float:
  """Seconds to all-reduce ``nbytes`` per GPU over ``gpus`` GPUs of ``cluster`` by ``plan``."""
  local, nodes = shape(gpus, cluster)
  if gpus <= 1:
    return 0.0
  if nodes == 1:
    return cost_model.ring_all_reduce(nbytes, local, cluster.intra_latency,
                                      cluster.intra_bandwidth)
  if plan.algorithm == "flat":
    # a ring through every GPU, node by node: each node's NIC carries one ring link
    return cost_model.ring_all_reduce(nbytes, gpus, cluster.inter_latency,
                                      cluster.inter_bandwidth, plan.wire_ratio)
  return (cost_model.ring_all_reduce(nbytes, local, cluster.intra_latency,
                                     cluster.intra_bandwidth)
          + node_level_seconds(nbytes, gpus, cluster, plan))


def node_level_seconds(nbytes: float, gpus: int, cluster: Cluster, plan: Plan) -> float:
  """The node level of the hierarchical all-reduce of ``nbytes`` per GPU: each GPU all-reduces
  its ``1/local`` share over the nodes, with the codec's encode and decode of every hop's chunk.
  What a DiLoCo sync sends (``simulate.diloco``); the fast level is the rest of the all-reduce."""
  local, nodes = shape(gpus, cluster)
  if nodes == 1:
    return 0.0
  # the node's GPUs run their node-level rings side by side and share its NICs
  level = Level("node", nodes, cluster.inter_bandwidth / local, cluster.inter_latency)
  t = cost_model.hierarchical_all_reduce(nbytes / local, [level], [plan.wire_ratio])
  if plan.codec != "none":
    t += 2 * (nodes - 1) / nodes * (nbytes / local) / cluster.codec_bandwidth
  return t


@dataclasses.dataclass(frozen=True)
class Step:
  gpus: int
  compute_s: float        # forward + backward of one GPU's batch
  comm_s: float           # every reduction's time, summed
  step_s: float           # with overlap
  buckets: int

  @property
  def exposed_s(self) -> float:
    return self.step_s - self.compute_s

  @property
  def efficiency(self) -> float:
    """Scaling efficiency against one GPU (weak scaling: the batch per GPU is fixed)."""
    return self.compute_s / self.step_s


def backward(layers: Sequence[Layer], *, batch_per_gpu: int, flops_per_s: float,
             bucket_bytes: float = 25 << 20, grad_bytes: int = 4):
  """The forward pass's seconds, the backward pass's end, and each bucket as (the time its last
  gradient is ready, its bytes), in backward order."""
  forward = sum(lay.flops for lay in layers) * batch_per_gpu / flops_per_s
  t, fill, ready = forward, 0.0, []
  for lay in reversed(layers):
    t += 2 * lay.flops * batch_per_gpu / flops_per_s
    fill += lay.params * grad_bytes
    if fill >= bucket_bytes:
      ready.append((t, fill))
      fill = 0.0
  if fill:
    ready.append((t, fill))
  return forward, t, ready


def step(layers: Sequence[Layer], cluster: Cluster, gpus: int, plan: Plan, *,
         batch_per_gpu: int, flops_per_s: float, bucket_bytes: float = 25 << 20,
         grad_bytes: int = 4, overlap: bool = True) -> Step:
  """The timeline of one step (see the module docstring)."""
  forward, compute, ready = backward(layers, batch_per_gpu=batch_per_gpu, flops_per_s=flops_per_s,
                                     bucket_bytes=bucket_bytes, grad_bytes=grad_bytes)
  net_free, comm = (forward if overlap else compute), 0.0
  for when, nbytes in ready:
    cost = all_reduce_seconds(nbytes, gpus, cluster, plan)
    net_free = max(net_free, when if overlap else net_free) + cost
    comm += cost
  return Step(gpus, compute, comm, max(compute, net_free), len(ready))


def flops_per_s(cluster: Cluster, layers: Sequence[Layer]) -> float:
  """The cluster's compute rate on ``layers``, from its ResNet-50 images/s (3 FLOPs per forward
  FLOP: forward and backward)."""
  from jaxring._src.tools.simulate.model import resnet50
  return cluster.resnet50_images_per_s * 3 * sum(lay.flops for lay in resnet50())
