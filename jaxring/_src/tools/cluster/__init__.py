"""The emulated multi-node cluster behind ``jaxring cluster`` (network namespaces + tc)."""
from jaxring._src.tools.cluster.cli import main as main
from jaxring._src.tools.cluster.launch import run as run
from jaxring._src.tools.cluster.netns import ClusterError as ClusterError
from jaxring._src.tools.cluster.netns import ClusterState as ClusterState
from jaxring._src.tools.cluster.netns import down as down
from jaxring._src.tools.cluster.netns import interface_counters as interface_counters
from jaxring._src.tools.cluster.netns import link_counters as link_counters
from jaxring._src.tools.cluster.netns import load_state as load_state
from jaxring._src.tools.cluster.netns import up as up
