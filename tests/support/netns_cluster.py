"""A throwaway several-node SLURM cluster on one machine: slurmctld on the host, and each node its
own network namespace (a veth pair into a bridge, an address in a private range used only here),
its own hostname and /etc/hosts, running its own slurmd; munge is shared. Ranks on different nodes
reach each other only through the nodes' eth0 interfaces, whose byte counters
(/proc/net/dev inside the namespace) tell what crossed the "network".

How a node is entered: `ip netns exec` remounts /sys, which hides /sys/fs/cgroup, and slurmd 22.05
then refuses to start; so slurmd runs under `nsenter --net` plus `unshare --mount --uts` (a private
mount namespace where a hosts file naming the nodes is bind-mounted on /etc/hosts).

One kernel still serves every node, so MPI would see one host and use shared memory between
"nodes": MPI_OVER_NETWORK is the environment that makes it use TCP over eth0 instead.
Needs root, iproute2 and util-linux (ip, nsenter, unshare) and slurm-wlm + munge."""
import os
import re
import subprocess
import time

from petra_mpi.perf import netns
from tests.support import slurm_cluster

# Ranks on different nodes talk over TCP on eth0 (why: petra_mpi/perf/netns.py).
MPI_OVER_NETWORK = netns.MPI_OVER_NETWORK


def missing() -> str | None:
    """Why the cluster cannot start here, or None."""
    why = slurm_cluster.missing()
    if why:
        return why
    for tool in ("ip", "nsenter", "unshare"):
        if not slurm_cluster._sbin(tool):
            return f"{tool} not found: apt-get install iproute2 util-linux"
    return netns.missing()


class NetnsCluster(slurm_cluster.Cluster):
    """A controller and len(nodes) nodes of `cpus` CPUs each, in network namespaces."""

    def __init__(self, root, nodes=("n1", "n2", "n3"), cpus=2, slurmd_timeout=10):
        super().__init__(root, cpus=cpus)
        self.nodes = list(nodes)
        self.slurmd_timeout = slurmd_timeout
        self.network = netns.Network(self.nodes)
        self.namespaces = self.network.namespaces
        self.controller_addr = self.network.host_addr
        self.addrs = self.network.addrs
        self.controller = None  # slurmctld (Popen)
        self.shm_before = set()

    # ---- the network ----
    def _make_network(self):
        self.network.make()
        with open(os.path.join(self.root, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.write(f"{self.controller_addr} {self.host}\n")
            f.writelines(f"{a} {n}\n" for n, a in self.addrs.items())

    def in_node(self, node, argv) -> list[str]:
        """argv run inside `node`: its network, its hostname, its /etc/hosts."""
        inner = (f"mount --bind {self.root}/hosts /etc/hosts && hostname {node} && "
                 f"exec \"$@\"")
        return ["nsenter", f"--net=/run/netns/{self.namespaces[node]}", "unshare", "--mount",
                "--uts", "--propagation", "private", "sh", "-c", inner, "sh", *argv]

    def link(self, node, up: bool):
        """Take `node`'s cable out (up=False) or plug it back in."""
        self.network.set_link(node, up)

    def eth0_bytes(self, node) -> tuple[int, int]:
        """(received, sent) bytes of `node`'s eth0 since the cluster started."""
        return self.network.eth0_bytes(node)

    def node_pids(self, node) -> list[int]:
        """Every process inside `node` (its slurmd, job steps, ranks)."""
        return self.network.pids(node)

    def kill_node(self, node):
        """The node dies: SIGKILL to every process in it, slurmd included."""
        self.network.kill(node)

    def start_node(self, node):
        """(Re)start `node`'s slurmd."""
        out = open(os.path.join(self.root, "log", f"slurmd-{node}.out"), "a")
        p = subprocess.Popen(
            self.in_node(node, [slurm_cluster._sbin("slurmd"), "-D", "-N", node, "-f",
                                self.conf]),
            stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append(p)

    # ---- SLURM ----
    def _write_conf(self):
        super()._write_conf()
        r = self.root
        with open(os.path.join(r, "gres.conf"), "w") as f:
            f.write(f"NodeName={','.join(self.nodes)} Name=gpu File={r}/gpu/gpu[0-1]\n")
        drop = ("NodeName=", "PartitionName=", "SlurmdSpoolDir=", "SlurmdPidFile=",
                "SlurmdLogFile=", "SlurmdPort=", "SlurmctldHost=", "ReturnToService=")
        keep = [line for line in open(self.conf).read().splitlines()
                if not line.startswith(drop)]
        port = slurm_cluster._free_port()  # every node has its own network: one port serves all
        keep += [f"SlurmctldHost={self.host}({self.controller_addr})",
                 f"SlurmdSpoolDir={r}/spool/%n", f"SlurmdPidFile={r}/slurmd-%n.pid",
                 f"SlurmdLogFile={r}/log/slurmd-%n.log", f"TmpFS={r}/tmp/%n",
                 # a node that comes back after dying is usable again at once
                 "ReturnToService=2",
                 # a node is declared down this long after it stops answering
                 f"SlurmdTimeout={self.slurmd_timeout}",
                 # job credentials (and how long a requeued job waits before it may start)
                 "AuthInfo=cred_expire=10"]
        keep += [f"NodeName={n} NodeHostname={n} NodeAddr={a} Port={port} CPUs={self.cpus} "
                 f"Gres=gpu:2 State=UNKNOWN" for n, a in self.addrs.items()]
        keep.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
                    f"MaxTime=INFINITE State=UP")
        with open(self.conf, "w") as f:
            f.write("\n".join(keep) + "\n")
        for n in self.nodes:
            os.makedirs(os.path.join(r, "spool", n), exist_ok=True)
            os.makedirs(os.path.join(r, "tmp", n), exist_ok=True)

    def start(self, timeout=60):
        try:
            self.shm_before = set(os.listdir("/dev/shm"))
            self._make_network()
            self._start_munge()
            self._write_conf()
            out = open(os.path.join(self.root, "log", "slurmctld.out"), "w")
            self.controller = subprocess.Popen([slurm_cluster._sbin("slurmctld"), "-D", "-c",
                                                "-f", self.conf], stdout=out,
                                               stderr=subprocess.STDOUT, env=self.env)
            self.procs.append(self.controller)
            for n in self.nodes:
                self.start_node(n)
            self.wait_nodes(["idle"] * len(self.nodes), timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def node_states(self) -> list[str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return [states.get(n, "?") for n in self.nodes]

    def wait_nodes(self, want, timeout=60):
        deadline = time.time() + timeout
        while (states := self.node_states()) != want:
            if self.controller.poll() is not None:
                raise RuntimeError(f"slurmctld exited: {self._tail('log/slurmctld.log')}")
            if time.time() > deadline:
                raise RuntimeError(f"nodes {states}, not {want}, after {timeout} s: "
                                   + self._tail("log/slurmctld.log"))
            time.sleep(0.5)

    def stop(self):
        """Daemons, then every process left in the namespaces, the namespaces, the bridge, and
        the MPI shared-memory segments our jobs left in /dev/shm."""
        try:
            super().stop()
        finally:
            self.network.remove()
            self._remove_shm()

    def _remove_shm(self):
        """Segments that appeared while the cluster ran and that no process maps any more (a
        killed rank leaves its job's segment behind; an MPI job elsewhere keeps its own mapped)."""
        new = {s for s in set(os.listdir("/dev/shm")) - self.shm_before if s.startswith("mpich")}
        if not new:
            return
        mapped = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/maps") as f:
                    mapped.update(re.findall(r"/dev/shm/(\S+)", f.read()))
            except OSError:
                pass
        for name in new - mapped:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass

