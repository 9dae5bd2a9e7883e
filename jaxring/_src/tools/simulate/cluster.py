"""Machines the simulator ships: GPUs per node, link rates and latencies, compute and codec rates.

Link figures are one direction. ``inter_bandwidth`` is what one node can send (all its NICs);
a reduction whose node-level rings run side by side (one per GPU of the node, BlueConnect) shares
it. Compute is a measured ResNet-50 training rate per GPU, turned into FLOP/s with the model's
FLOPs (3x the forward pass for forward + backward).
"""
from __future__ import annotations

import dataclasses

# Measured here: one H100 80GB, ResNet-50 at 224x224, bf16, batch 256 (docs/benchmarks.md).
H100_RESNET50_IMAGES_PER_S = 5593.0


@dataclasses.dataclass(frozen=True)
class Cluster:
  name: str
  gpus_per_node: int
  intra_bandwidth: float        # bytes/s per GPU inside a node (NVLink, PCIe, memory copy)
  intra_latency: float          # seconds per message inside a node
  inter_bandwidth: float        # bytes/s per node across nodes
  inter_latency: float          # seconds per message across nodes
  resnet50_images_per_s: float  # one GPU's training rate, the compute reference
  codec_bandwidth: float        # bytes/s of f32 input one GPU encodes and decodes
  about: str = ""


def _gbit(x: float) -> float:
  return x * 1e9 / 8


CLUSTERS = {c.name: c for c in (
    Cluster("h100-nvlink-ib400", 8, 370e9, 3e-6, 8 * _gbit(400), 5e-6, H100_RESNET50_IMAGES_PER_S,
            1.2e12, "DGX H100 style: NVLink 4 inside, one 400 Gbit/s InfiniBand NIC per GPU"),
    Cluster("8xh100-100gbe", 8, 370e9, 3e-6, _gbit(100), 30e-6, H100_RESNET50_IMAGES_PER_S,
            1.2e12, "8 H100 per node on NVLink, one 100 GbE NIC per node (TCP)"),
    Cluster("8xh100-25gbe", 8, 370e9, 3e-6, _gbit(25), 50e-6, H100_RESNET50_IMAGES_PER_S,
            1.2e12, "8 H100 per node on NVLink, one 25 GbE NIC per node (cloud Ethernet)"),
    Cluster("8xh100-10gbe", 8, 370e9, 3e-6, _gbit(10), 50e-6, H100_RESNET50_IMAGES_PER_S,
            1.2e12, "8 H100 per node on NVLink, one 10 GbE NIC per node"),
    Cluster("emulated", 2, 14e9, 20e-6, _gbit(1), 2e-3, 0.0, 2e9,
            "this machine's emulated cluster: 2 CPU devices per namespace, 1 Gbit/s tbf links "
            "(latency: a 4 KiB gloo all-reduce over 4 nodes took 13 ms); no compute reference"),
)}
