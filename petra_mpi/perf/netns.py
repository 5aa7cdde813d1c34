"""Network namespaces on this machine joined by a bridge, one per "node": each has its own eth0
(one end of a veth pair whose other end is in the bridge) with an address in a private /24
used only here, and the bridge has the host's address .1 on it. Nothing touches the host's own
interfaces. A node's traffic to the others crosses its eth0, whose byte counters tell what went
over the "network", and whose egress `tc netem` can slow to a given rate and delay.

One kernel still serves every node, so MPI would see one host and use shared memory between
nodes: MPI_OVER_NETWORK is the environment that makes MPICH use TCP over eth0 instead.
Needs root and iproute2 (ip, tc)."""
import os
import random
import re
import shutil
import subprocess

# MPICH's OFI netmod with the tcp provider: with UCX (MPICH's default netmod here) ranks in
# different namespaces would use shared memory (UCX decides "same host" from the kernel, not the
# network namespace), and UCX's TCP-only configuration (UCX_TLS=self,tcp UCX_NET_DEVICES=eth0)
# failed MPI_Init in some clusters.
MPI_OVER_NETWORK = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0"}
# Ranks started on one host (mpirun, no cluster): every rank also treats every other one as on
# another node, so that nothing between them goes through shared memory.
NO_LOCAL_RANKS = {"MPIR_CVAR_NOLOCAL": "1"}


def missing() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"{tool} not found: apt-get install iproute2"
    probe = f"petraprobe{os.getpid()}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def rate_bits(text: str) -> float:
    """A tc rate in bits per second: `250mbit` -> 2.5e8."""
    m = re.fullmatch(r"([\d.]+)(bit|kbit|mbit|gbit)", text)
    if not m:
        raise ValueError(f"{text}: give a tc rate such as 10gbit or 250mbit")
    return float(m.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Network:
    """Namespaces for `nodes` (names), joined by a bridge; make() builds it, remove() takes down
    all of it (killing what still runs inside), also when make() stopped half-way."""

    def __init__(self, nodes, prefix="petra"):
        self.nodes = list(nodes)
        # Names and a /24 of our own, so networks made at once (or left by a killed run) never
        # share a namespace, bridge or address.
        tag = f"{random.randrange(16 ** 5):05x}"
        self.namespaces = {n: f"{prefix}{tag}{n}" for n in self.nodes}
        self.bridge = f"pbr{tag}"
        self.subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
        self.host_addr = f"{self.subnet}.1"
        self.addrs = {n: f"{self.subnet}.{11 + i}" for i, n in enumerate(self.nodes)}

    def _host_end(self, node) -> str:
        return f"{self.bridge}v{self.nodes.index(node)}"

    def make(self) -> "Network":
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for n in self.nodes:
                ns, host_end = self.namespaces[n], self._host_end(n)
                ip("netns", "add", ns)
                ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
                ip("link", "set", host_end, "master", self.bridge, "up")
                ip("-n", ns, "addr", "add", f"{self.addrs[n]}/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def __enter__(self):
        return self.make()

    def __exit__(self, *exc):
        self.remove()

    def run_in(self, node) -> list[str]:
        """The argv prefix that runs a command inside `node`'s network."""
        return ["ip", "netns", "exec", self.namespaces[node]]

    def set_link(self, node, up: bool):
        """Take `node`'s cable out (up=False) or plug it back in."""
        ip("link", "set", self._host_end(node), "up" if up else "down")

    def limit(self, node, rate: str | None, delay_us: float = 0.0):
        """What leaves `node`'s eth0 goes at most at `rate` (tc's units: 1gbit, 250mbit) and
        `delay_us` later; rate None and no delay: as fast as the kernel copies it. A delay takes
        netem (a kernel module of its own, missing from some kernels: has_netem); a rate alone
        a token bucket (tbf), which every kernel with traffic control has."""
        ns = self.namespaces[node]
        ip("netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        if rate is None and not delay_us:
            return
        if delay_us:  # queues deep enough that a burst of large messages waits, never drops
            qdisc = ["netem", "limit", "100000", "delay", f"{delay_us}us",
                     *(["rate", rate] if rate else [])]
        else:  # a bucket of 2 ms at the rate (at least 256 kB: a whole GSO packet fits)
            burst = max(256 << 10, int(rate_bits(rate) / 8 * 2e-3))
            qdisc = ["tbf", "rate", rate, "burst", str(burst), "limit", str(64 << 20)]
        done = ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *qdisc,
                  check=False)
        if done.returncode != 0:
            raise RuntimeError(f"tc qdisc add dev eth0 root {' '.join(qdisc)}: "
                               f"{done.stderr.strip()}")

    def has_netem(self) -> bool:
        """Whether this kernel has netem (tried on the first node's loopback)."""
        ns = self.namespaces[self.nodes[0]]
        made = ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                  "delay", "1us", check=False)
        ip("netns", "exec", ns, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
        return made.returncode == 0

    def eth0_bytes(self, node) -> tuple[int, int]:
        """(received, sent) bytes of `node`'s eth0 since it was made."""
        out = ip("netns", "exec", self.namespaces[node], "cat", "/proc/net/dev").stdout
        for line in out.splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == "eth0":
                fields = counters.split()
                return int(fields[0]), int(fields[8])
        raise RuntimeError(f"no eth0 in {self.namespaces[node]}: {out}")

    def pids(self, node) -> list[int]:
        """Every process inside `node`."""
        out = ip("netns", "pids", self.namespaces[node], check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self, node):
        """SIGKILL to every process inside `node`."""
        for pid in self.pids(node):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def remove(self):
        """Every process left in the namespaces, the namespaces, the veths and the bridge (what
        is not there is skipped)."""
        for n in self.nodes:
            self.kill(n)
            ip("link", "del", self._host_end(n), check=False)
            ip("netns", "del", self.namespaces[n], check=False)
        ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """Namespaces or links of this network that still exist (none after remove())."""
        names = set(ip("netns", "list", check=False).stdout.split())
        links = ip("-o", "link", "show", check=False).stdout
        return ([ns for ns in self.namespaces.values() if ns in names]
                + [name for name in (self.bridge, *map(self._host_end, self.nodes))
                   if f" {name}:" in links or f" {name}@" in links])
