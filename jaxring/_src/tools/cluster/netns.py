"""An emulated cluster: network namespaces joined by rate-limited veth links through a bridge.

Layout for a cluster named ``jr0`` with K nodes::

    jr0-n0 [jreth0 10.213.0.1] --veth-- [jrp0]                        each link: tc tbf on both
    jr0-n1 [jreth0 10.213.0.2] --veth-- [jrp1]  jrbr0 in jr0-br       ends, rate R, burst B,
    ...                                                               latency 50 ms

Only the namespace names are global; every interface lives inside a namespace created here, so
nothing on the host changes and no traffic can leave the namespaces. The state file records
exactly which namespaces were created, and :func:`down` deletes exactly those (which also deletes
the veths, the bridge and the qdiscs inside them).

With ``quickack`` (``jaxring cluster up --quickack``) each node's route to the others acknowledges
every TCP segment at once, where Linux by default may hold an ACK back for 40 ms or more to send
it with data. The default keeps Linux's behaviour. Measured (docs/design.md, "Investigations"):
with delayed ACKs a third of the JAX shape's 1 MiB all-reduces stalled to
2-12x the others, each stalled call with a delayed ACK; at once, 2-7% did, while all-reduces of
64 KiB and less took 12-27% longer (an ACK packet for every segment, on the shared cores).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import shutil
import subprocess
import time

NODE_INTERFACE = "jreth0"
BRIDGE = "jrbr0"
DEFAULT_NAME = "jr0"
DEFAULT_SUBNET = "10.213.0.0/24"
NAME_PATTERN = re.compile(r"^jr[a-z0-9]{0,8}$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}

# Linux capabilities (include/uapi/linux/capability.h): netns add mounts, link add needs NET_ADMIN.
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21


class ClusterError(RuntimeError):
  """A cluster operation failed; the message says what to do."""


def rate_bytes_per_second(rate: str) -> float:
  """Parses a tc rate (``1gbit``, ``100mbit``, ``125mbps``) into bytes per second.

  Example:
    >>> rate_bytes_per_second("1gbit")
    125000000.0
  """
  m = _RATE.match(rate.strip().lower())
  if not m:
    raise ClusterError(f"rate {rate!r} is not a tc rate like 1gbit, 100mbit or 125mbps")
  value, unit = float(m.group(1)), m.group(2)
  scale = _UNITS[unit[0] if unit[0] in "kmgt" else ""]
  return value * scale / 8 if unit.endswith("bit") else value * scale


@dataclasses.dataclass
class ClusterState:
  """What ``up`` created, as written to and read from the state file."""

  name: str
  nodes: int
  subnet: str
  rate: str
  burst: str
  latency: str
  quickack: bool = False
  namespaces: list[str] = dataclasses.field(default_factory=list)   # created, in order
  complete: bool = False
  created_at: float = dataclasses.field(default_factory=time.time)

  @property
  def bridge_namespace(self) -> str:
    return f"{self.name}-br"

  def node_namespace(self, node: int) -> str:
    return f"{self.name}-n{node}"

  def address(self, node: int) -> str:
    return str(ipaddress.ip_network(self.subnet)[node + 1])

  @property
  def prefix_length(self) -> int:
    return ipaddress.ip_network(self.subnet).prefixlen

  @property
  def interface(self) -> str:
    return NODE_INTERFACE

  @property
  def bandwidth(self) -> float:
    return rate_bytes_per_second(self.rate)


def state_dir() -> str:
  if os.geteuid() == 0:
    return "/run/jaxring-cluster"
  return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/jaxring-{os.getuid()}",
                      "jaxring-cluster")


def state_path(name: str) -> str:
  return os.path.join(state_dir(), f"{name}.json")


def load_state(name: str) -> ClusterState | None:
  try:
    with open(state_path(name)) as f:
      return ClusterState(**json.load(f))
  except FileNotFoundError:
    return None


def _save_state(state: ClusterState) -> None:
  os.makedirs(state_dir(), mode=0o700, exist_ok=True)
  tmp = state_path(state.name) + ".tmp"
  with open(tmp, "w") as f:
    json.dump(dataclasses.asdict(state), f, indent=1)
  os.replace(tmp, state_path(state.name))


def check_name(name: str) -> None:
  if not NAME_PATTERN.match(name):
    raise ClusterError(f"cluster name {name!r} must match {NAME_PATTERN.pattern} (jr prefix, "
                       "at most 10 characters) so that everything it creates is recognisable")


def _capabilities() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("CapEff:"):
        return int(line.split()[1], 16)
  return 0


def require_privileges() -> None:
  """Raises ClusterError naming what is missing to create namespaces, links and qdiscs."""
  missing_tools = [t for t in ("ip", "tc") if shutil.which(t) is None]
  if missing_tools:
    raise ClusterError(f"jaxring cluster needs the iproute2 tools {missing_tools} on PATH "
                       "(Debian/Ubuntu: apt-get install iproute2)")
  caps = _capabilities()
  missing = [name for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"),
                                    (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN")) if not caps >> bit & 1]
  if missing:
    raise ClusterError(f"jaxring cluster needs root: creating network namespaces, veth links and "
                       f"tc qdiscs requires {' and '.join(missing)}, which this process lacks "
                       f"(euid {os.geteuid()}). Run it with sudo.")


def sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
  """Runs one ip/tc command; a failure raises ClusterError with the command and its stderr."""
  proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
  if check and proc.returncode != 0:
    raise ClusterError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): "
                       f"{proc.stderr.strip() or proc.stdout.strip()}")
  return proc


def existing_namespaces() -> set[str]:
  out = sh("ip", "netns", "list", check=False).stdout
  return {line.split()[0] for line in out.splitlines() if line.strip()}


def _add_namespace(state: ClusterState, ns: str) -> None:
  sh("ip", "netns", "add", ns)
  state.namespaces.append(ns)
  _save_state(state)
  sh("ip", "-n", ns, "link", "set", "lo", "up")


def _shape(ns: str, dev: str, state: ClusterState) -> None:
  sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", state.rate,
     "burst", state.burst, "latency", state.latency)


def _acknowledge_at_once(ns: str, state: ClusterState, node: int) -> None:
  """The node's route to the cluster's subnet without delayed ACKs (``quickack 1``)."""
  sh("ip", "-n", ns, "route", "replace", state.subnet, "dev", NODE_INTERFACE, "proto", "kernel",
     "scope", "link", "src", state.address(node), "quickack", "1")


def up(name: str = DEFAULT_NAME, nodes: int = 2, *, rate: str = "1gbit", burst: str = "256kb",
       latency: str = "50ms", subnet: str = DEFAULT_SUBNET, quickack: bool = False) -> ClusterState:
  """Creates the namespaces, links and qdiscs of a K-node cluster; returns its state.

  ``quickack``: TCP inside the nodes acknowledges every segment at once (see the module's
  docstring); False (the default) keeps Linux's delayed ACKs.

  Example:
    >>> state = up("jr0", nodes=2, rate="1gbit")  # doctest: +SKIP
    >>> state.address(1), state.interface  # doctest: +SKIP
    ('10.213.0.2', 'jreth0')
  """
  check_name(name)
  rate_bytes_per_second(rate)
  net = ipaddress.ip_network(subnet)
  if not net.is_private or net.num_addresses < nodes + 2:
    raise ClusterError(f"subnet {subnet} must be a private network with room for {nodes} nodes")
  if nodes < 1:
    raise ClusterError(f"--nodes must be >= 1, got {nodes}")
  require_privileges()
  if load_state(name) is not None:
    raise ClusterError(f"cluster {name!r} is already up (state file {state_path(name)}); run "
                       f"`jaxring cluster down --name {name}` first or pick another --name")
  state = ClusterState(name, nodes, str(net), rate, burst, latency, quickack)
  planned = [state.bridge_namespace] + [state.node_namespace(i) for i in range(nodes)]
  clash = sorted(set(planned) & existing_namespaces())
  if clash:
    raise ClusterError(f"network namespaces {clash} already exist but are not recorded as "
                       f"cluster {name!r}; pick another --name (they were not created here)")
  _save_state(state)
  try:
    br = state.bridge_namespace
    _add_namespace(state, br)
    sh("ip", "-n", br, "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "-n", br, "link", "set", BRIDGE, "up")
    for i in range(nodes):
      ns, port = state.node_namespace(i), f"jrp{i}"
      _add_namespace(state, ns)
      sh("ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", NODE_INTERFACE,
         "netns", ns)
      sh("ip", "-n", br, "link", "set", port, "master", BRIDGE)
      sh("ip", "-n", br, "link", "set", port, "up")
      sh("ip", "-n", ns, "addr", "add", f"{state.address(i)}/{state.prefix_length}",
         "dev", NODE_INTERFACE)
      sh("ip", "-n", ns, "link", "set", NODE_INTERFACE, "up")
      if quickack:
        _acknowledge_at_once(ns, state, i)
      _shape(ns, NODE_INTERFACE, state)
      _shape(br, port, state)
  except BaseException as exc:
    try:
      down(name)
    except ClusterError as cleanup:
      raise ClusterError(f"{exc}; cleaning up also failed: {cleanup}") from exc
    raise
  state.complete = True
  _save_state(state)
  return state


def down(name: str = DEFAULT_NAME) -> list[str]:
  """Deletes the namespaces recorded in the state file (and so all inside them); idempotent.

  Returns:
    The namespaces deleted (empty when there was nothing to delete).

  Example:
    >>> down("jr0")  # doctest: +SKIP
    ['jr0-n1', 'jr0-n0', 'jr0-br']
  """
  check_name(name)
  state = load_state(name)
  if state is None:
    return []
  require_privileges()
  present = existing_namespaces()
  deleted, errors = [], []
  for ns in reversed(state.namespaces):
    if ns in present:
      proc = sh("ip", "netns", "del", ns, check=False)
      if proc.returncode == 0:
        deleted.append(ns)
      else:
        errors.append(f"{ns}: {proc.stderr.strip()}")
  if errors:
    raise ClusterError("could not delete " + "; ".join(errors) + f" (state kept in "
                       f"{state_path(name)}; retry `jaxring cluster down --name {name}`)")
  os.unlink(state_path(name))
  return deleted


def interface_counters(namespace: str, interface: str = NODE_INTERFACE) -> dict[str, int]:
  """Bytes and packets an interface has sent and received, read inside its namespace.

  Example:
    >>> interface_counters("jr0-n0")["tx_bytes"]  # doctest: +SKIP
    123456
  """
  names = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
  paths = [f"/sys/class/net/{interface}/statistics/{n}" for n in names]
  out = sh("ip", "netns", "exec", namespace, "cat", *paths).stdout.split()
  return dict(zip(names, map(int, out)))


def link_counters(name: str = DEFAULT_NAME) -> list[dict[str, int]]:
  """Per node, the counters of its link (index = node): what each node put on the wire."""
  state = load_state(name)
  if state is None:
    raise ClusterError(f"cluster {name!r} is not up")
  return [interface_counters(state.node_namespace(i)) for i in range(state.nodes)]


def describe(name: str = DEFAULT_NAME) -> str:
  """A human-readable account of what exists for cluster ``name``."""
  state = load_state(name)
  if state is None:
    return f"cluster {name!r}: not up (no state file {state_path(name)})"
  present = existing_namespaces()
  lines = [f"cluster {name!r}: {state.nodes} nodes, links {state.rate} (burst {state.burst}, "
           f"latency {state.latency}), subnet {state.subnet}, "
           f"{'ACKs at once' if state.quickack else 'delayed ACKs'}"
           + ("" if state.complete else "  [INCOMPLETE: `up` did not finish; run down]"),
           f"  state file {state_path(name)}"]
  for ns in state.namespaces:
    if ns not in present:
      lines.append(f"  {ns}: MISSING")
      continue
    if ns == state.bridge_namespace:
      lines.append(f"  {ns}: bridge {BRIDGE}")
      continue
    node = int(ns.rsplit("-n", 1)[1])
    qdisc = sh("tc", "-n", ns, "qdisc", "show", "dev", NODE_INTERFACE, check=False).stdout.strip()
    try:
      c = interface_counters(ns)
      traffic = f"tx {c['tx_bytes']} B, rx {c['rx_bytes']} B"
    except ClusterError:
      traffic = "counters unreadable"
    lines.append(f"  {ns}: {NODE_INTERFACE} {state.address(node)}/{state.prefix_length}, "
                 f"{traffic}; {qdisc.splitlines()[0] if qdisc else 'no qdisc'}")
  return "\n".join(lines)


def loss_unsupported() -> str | None:
  """Why random packet loss cannot be emulated here, or None.

  ``tc netem`` is the usual tool; kernels built without it (this project's machines: only
  ``tbf``) still drop at random with iptables' ``statistic`` match inside a node's namespace.
  """
  if shutil.which("iptables") is None:
    return "iptables is not installed (apt-get install iptables)"
  probe = sh("iptables", "-m", "statistic", "--help", check=False)
  if probe.returncode != 0 or "--probability" not in probe.stdout:
    return "iptables has no statistic match"
  return None


def set_loss(name: str, node: int, percent: float) -> None:
  """Drops ``percent`` % of the packets node ``node`` sends and receives, at random (0: none).

  The rules live in the node's own namespace (created by :func:`up`), which goes with ``down``.

  Example:
    >>> set_loss("jr0", 1, 5.0)  # doctest: +SKIP
  """
  state = load_state(name)
  if state is None or not 0 <= node < state.nodes:
    raise ClusterError(f"cluster {name!r} is not up or has no node {node}")
  if not 0 <= percent <= 100:
    raise ClusterError(f"loss must be within 0..100 %, got {percent}")
  ns = state.node_namespace(node)
  for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
    sh("ip", "netns", "exec", ns, "iptables", "-F", chain)
    if percent > 0:
      sh("ip", "netns", "exec", ns, "iptables", "-A", chain, flag, NODE_INTERFACE, "-m",
         "statistic", "--mode", "random", "--probability", f"{percent / 100:.6f}", "-j", "DROP")


def dropped_packets(name: str, node: int) -> int:
  """Packets the loss rules of node ``node`` have dropped so far."""
  state = load_state(name)
  ns = state.node_namespace(node)
  total = 0
  for chain in ("INPUT", "OUTPUT"):
    out = sh("ip", "netns", "exec", ns, "iptables", "-L", chain, "-n", "-v", "-x").stdout
    total += sum(int(line.split()[0]) for line in out.splitlines() if " DROP " in line)
  return total


def set_link(name: str, node: int, up: bool) -> None:
  """Takes node ``node``'s link down (or back up) at the bridge's end."""
  state = load_state(name)
  if state is None or not 0 <= node < state.nodes:
    raise ClusterError(f"cluster {name!r} is not up or has no node {node}")
  sh("ip", "-n", state.bridge_namespace, "link", "set", f"jrp{node}", "up" if up else "down")
