"""`python -m petra_mpi.bench link` (as root on one Linux machine, with iproute2): images/s of
PETRA and backprop against the bandwidth of the link between the ranks, measured and as the
performance model predicts it.

It makes one network namespace per rank, joined by a bridge on a private /24 (nothing touches
the host's interfaces: petra_mpi/perf/netns.py), and runs `bench pipeline` under mpirun with
rank r inside namespace r and MPI over TCP on the namespaces' eth0 (MPICH's OFI netmod, no
shared memory). For each rate it slows every namespace's eth0 with `tc qdisc ... netem rate R
delay D` (a kernel without netem: `tbf rate R`, no delay added), and runs the bench with and
without compressed messages. Per point: images/s, bytes
sent per tick, the bytes that crossed the interfaces, and the model's images/s for the same
point (model.simulate with busy links: the run's compute per micro-batch, the bytes its
messages carry, latency D plus the measured one of the unlimited link, bandwidth R / 8). The
namespaces are removed at the end, also when a run fails or the bench is interrupted.

Writes each run's output and figures to --out (NAME.txt, NAME.json), the sweep to
--out/link_sweep.json and the plot to --png. --reuse takes the points already in --out
instead of running them again (to run a long sweep a few rates at a time)."""
import argparse
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

from .. import netns
from .. import model as perfmodel
from ...comm.compress import Codec
from ...core.blockcost import BlockCosts
from ...core.schedule import num_ticks
from .common import emit
from .pipeline import scaled_to

METHODS = ("petra", "backprop")
KNEE = 0.9  # a curve is link-bound once it runs below this share of its unlimited rate


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m petra_mpi.bench link", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rates", default="none,10gbit,3gbit,1gbit,500mbit,250mbit",
                   help="tc rates of each point, `none` for no limit")
    p.add_argument("--delay-us", type=float, default=50.0, help="netem delay at every rate")
    p.add_argument("--compress", default="forward=int8,rebuilt=int8,gradient=int8",
                   help="the compressed variant's messages ('' : uncompressed only)")
    p.add_argument("--out", default="runs/bench/link")
    p.add_argument("--png", default=None, help="default OUT/link_sweep.png; '' to skip")
    p.add_argument("--reuse", action="store_true", help="keep the points already in --out")
    p.add_argument("--timeout", type=int, default=300, help="seconds per point")
    p.add_argument("--ping-pong", action="store_true", help=argparse.SUPPRESS)  # under mpirun
    for name, default in (("arch", "revnet18"), ("width", 16), ("batch", 32),
                          ("microbatches", 16), ("rounds", 2), ("threads", 1)):
        p.add_argument(f"--{name}", default=default, type=type(default),
                       help="as bench pipeline's")
    p.add_argument("--partition", help="as bench pipeline's (default: the estimated split)")
    return p.parse_args(argv)


def parse_rate(text: str) -> float | None:
    """`250mbit` -> 2.5e8 bits/s; `none` -> None."""
    if text == "none":
        return None
    try:
        return netns.rate_bits(text)
    except ValueError as e:
        raise SystemExit(f"--rates {e}, or none")


def main(argv):
    a = parse_args(argv)
    if a.ping_pong:
        return ping_pong()
    rates = [(r, parse_rate(r)) for r in a.rates.split(",")]
    variants = {"plain": ""} | ({"compressed": a.compress} if a.compress else {})
    why = netns.missing()
    if why:
        raise SystemExit(f"bench link: {why}")
    os.makedirs(a.out, exist_ok=True)
    # a kill (timeout, the batch system) ends here too, so that the namespaces go with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    net = netns.Network([f"r{i}" for i in range(a.ranks)], prefix="petralink")
    points = []
    try:
        net.make()
        if a.delay_us and not net.has_netem():
            print(f"this kernel has no netem: no delay added (--delay-us {a.delay_us:g} "
                  f"dropped), the rates by a token bucket (tbf)", flush=True)
            a.delay_us = 0.0
        base = None
        for variant, compress in variants.items():
            for rate, bits in rates:
                path = os.path.join(a.out, f"{variant}_{rate}")
                if a.reuse and os.path.exists(path + ".json"):
                    with open(path + ".json") as f:
                        points.append(json.load(f))
                    continue
                base = base or unlimited_link(a, net)
                points.append(run_point(a, net, path, variant, compress, rate, bits, base))
    finally:
        net.remove()
    report(a, points)


def mpirun_argv(net, args) -> list[str]:
    """mpirun starting rank r inside namespace r (MPMD: one program per rank)."""
    argv = ["mpirun"]
    for i, node in enumerate(net.nodes):
        argv += ([":"] if i else []) + ["-n", "1", *net.run_in(node), sys.executable, "-m",
                                        "petra_mpi.bench", *args]
    return argv


def launch(a, net, args) -> subprocess.CompletedProcess:
    env = {**os.environ, **netns.MPI_OVER_NETWORK, **netns.NO_LOCAL_RANKS,
           "OMP_NUM_THREADS": str(a.threads or 1)}
    proc = subprocess.run(mpirun_argv(net, args), capture_output=True, text=True, env=env,
                          timeout=a.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"bench link: {' '.join(args[:1])} failed ({proc.returncode}):\n"
                         + proc.stdout[-2000:] + proc.stderr[-3000:])
    return proc


def ping_pong():
    """Under mpirun: the link between ranks 0 and 1 from ping-pong round trips (JSON on 0)."""
    from ...comm.world import World
    from .common import measure_link
    world = World.from_environment()
    link = measure_link(world, 4 << 20)
    if world.rank == 0:
        print(json.dumps({"latency_s": link.latency, "bandwidth_Bps": link.bandwidth}))


def unlimited_link(a, net) -> dict:
    """Latency and bandwidth of the link with no limit (what netem's delay adds to)."""
    for node in net.nodes:
        net.limit(node, None)
    proc = launch(a, net, ["link", "--ping-pong"])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_point(a, net, path, variant, compress, rate, bits, base) -> dict:
    """One bench pipeline run at one rate: its figures, the bytes that crossed every eth0."""
    for node in net.nodes:
        net.limit(node, rate if bits else None, a.delay_us)
    args = ["pipeline", "--arch", a.arch, "--width", str(a.width), "--batch", str(a.batch),
            "--microbatches", str(a.microbatches), "--rounds", str(a.rounds),
            "--threads", str(a.threads), "--compress", compress]
    # the same split at every point (a measured one moves with the machine's load)
    args += ["--partition", a.partition] if a.partition else ["--balance", "estimate"]
    before = [net.eth0_bytes(n)[1] for n in net.nodes]
    proc = launch(a, net, args)
    crossed = [net.eth0_bytes(n)[1] - b for n, b in zip(net.nodes, before)]
    with open(path + ".txt", "w") as f:
        f.write(proc.stdout)
    bench = json.loads(proc.stdout.strip().splitlines()[-1])
    point = {"variant": variant, "rate": rate, "bits_per_s": bits, "delay_us": a.delay_us,
             "unlimited_link": base, "eth0_sent_bytes": crossed,
             "payload_bytes": payload_bytes(bench, a.ranks), "pipeline": bench}
    point["model"] = model_point(point)
    with open(path + ".json", "w") as f:
        json.dump(point, f, indent=1)
    print(f"{variant:<10} {rate:>8}: PETRA {bench['petra_images_per_s']:.1f} images/s "
          f"(model {point['model']['petra']['images_per_s']:.1f}), backprop "
          f"{bench['backprop_images_per_s']:.1f}, eth0 {sum(crossed) / 1e6:.1f} MB for "
          f"{sum(point['payload_bytes']) / 1e6:.1f} MB of messages", flush=True)
    return point


def payload_bytes(bench, J) -> list[float]:
    """Per rank, the message bytes of the whole run: the timed segments (bytes per tick times
    their ticks) and the warm-up (one segment of J + 2 micro-batches per method, at the same
    bytes per micro-batch)."""
    n, rounds = bench["microbatches"], bench["rounds"]
    total = [0.0] * J
    for m in METHODS:
        for r, per_tick in enumerate(bench[f"{m}_sent_bytes_per_tick"]):
            timed = per_tick * num_ticks(m, J, n) * rounds
            total[r] += timed * (1 + (J + 2) / (n * rounds))
    return total


def link_of(point, bandwidth=None) -> perfmodel.Link:
    """The point's link: netem's delay beside the measured latency, the rate's bandwidth (or,
    with no limit, the one measured)."""
    base = point["unlimited_link"]
    bits = point["bits_per_s"]
    bandwidth = bandwidth or (bits / 8 if bits else base["bandwidth_Bps"])
    return perfmodel.Link(point["delay_us"] * 1e-6 + base["latency_s"], bandwidth)


def packed_bytes(nbytes: float, fmt: str) -> float:
    """Bytes of an fp32 message of `nbytes` in format `fmt` (int8: with its 4-byte scale;
    int8_channel's per-channel scales are left out)."""
    if fmt == "none":
        return nbytes
    return nbytes / 4 * Codec(fmt).code_dtype.itemsize + (4 if fmt == "int8" else 0)


def stage_model(bench, method, in_run=True) -> list:
    """The model's StageCosts of the run's split: its per-block costs timed at start-up, or
    (in_run) scaled to the compute per micro-batch each rank measured in the method's own
    runs; the messages in the run's formats (the backward sends δ and x̃)."""
    costs, split = BlockCosts(**bench["block_costs"]), bench["split"]
    if in_run:
        costs = scaled_to(costs, split, bench["stage_seconds_in_run"][method])
    formats = bench["compression"]
    return [replace(s, out_bytes=packed_bytes(s.out_bytes, formats["forward"]),
                    down_bytes=(packed_bytes(s.down_bytes / 2, formats["gradient"])
                                + packed_bytes(s.down_bytes / 2, formats["rebuilt"])))
            for s in perfmodel.stage_costs(costs, split)]


def model_point(point) -> dict:
    """Per method, the model's images/s at the point (with the run's compute, and with the
    costs timed at start-up) and the bytes per tick each rank sends."""
    bench, link = point["pipeline"], link_of(point)
    n, batch, J = bench["microbatches"], bench["batch"], bench["ranks"]
    out = {}
    for m in METHODS:
        stages = stage_model(bench, m)
        sent = [n * ((s.out_bytes if r < J - 1 else 0) + (s.down_bytes if r else 0))
                for r, s in enumerate(stages)]
        out[m] = {"images_per_s": perfmodel.predict_images_per_s(
                      m, stages, link, n, batch, busy_links=True),
                  "images_per_s_startup_costs": perfmodel.predict_images_per_s(
                      m, stage_model(bench, m, in_run=False), link, n, batch, busy_links=True),
                  "sent_bytes_per_tick": [b / num_ticks(m, J, n) for b in sent]}
    return out


def model_knee(point, method) -> float:
    """Gbit/s below which the model's rate falls under KNEE x its rate on an endless link
    (the point's compute and latency), by bisection on a log scale."""
    bench = point["pipeline"]
    stages = stage_model(bench, method)

    def rate(bandwidth):
        return perfmodel.predict_images_per_s(method, stages, link_of(point, bandwidth),
                                              bench["microbatches"], bench["batch"],
                                              busy_links=True)
    want, low, high = KNEE * rate(1e15), 1e4, 1e13
    for _ in range(60):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if rate(mid) < want else (low, mid)
    return high * 8 / 1e9


def gbits(point) -> float:
    """The point's bandwidth in Gbit/s (no limit: the measured one)."""
    bits = point["bits_per_s"] or 8 * point["unlimited_link"]["bandwidth_Bps"]
    return bits / 1e9


def measured_knee(points, method) -> list | None:
    """[faster, slower] Gbit/s between which the measured rate first falls under KNEE x the
    fastest point's (None: it never does)."""
    ordered = sorted(points, key=gbits, reverse=True)
    top = ordered[0]["pipeline"][f"{method}_images_per_s"]
    for faster, slower in zip(ordered, ordered[1:]):
        if slower["pipeline"][f"{method}_images_per_s"] < KNEE * top:
            return [gbits(faster), gbits(slower)]
    return None


def curves(points) -> dict:
    """{(variant, method): points of that variant, fastest link first}."""
    out = {}
    for p in points:
        for m in METHODS:
            out.setdefault((p["variant"], m), []).append(p)
    return {k: sorted(v, key=gbits, reverse=True) for k, v in out.items()}


def report(a, points):
    """The table, the knees, the sweep's JSON and the plot."""
    print_table(points)
    knees = {f"{v} {m}": {"measured_gbits": measured_knee(ps, m),
                          "model_gbits": model_knee(ps[0], m)}
             for (v, m), ps in sorted(curves(points).items())}
    for name, k in knees.items():
        seen = k["measured_gbits"]
        print(f"link-bound below ({KNEE:.0%} of the fastest): {name:<20} model "
              f"{k['model_gbits']:.2f} Gbit/s, measured "
              + (f"between {seen[0]:.2f} and {seen[1]:.2f}" if seen else "not within the sweep"))
    record = {"bench": "link", "ranks": a.ranks, "delay_us": a.delay_us, "knee_share": KNEE,
              "knees": knees}
    with open(os.path.join(a.out, "link_sweep.json"), "w") as f:
        json.dump(record | {"points": points}, f, indent=1)
    png = os.path.join(a.out, "link_sweep.png") if a.png is None else a.png
    if png:
        plot(points, png)
    emit(record | {"points": [summary(p) for p in points]})


def print_table(points):
    """Per point: measured images/s beside the model's (with the run's compute, and with the
    costs timed at start-up), PETRA's kB sent per tick per rank, and the bytes that left the
    interfaces over those of the messages."""
    print(f"{'variant':<10} {'link':>8} {'Gbit/s':>7}  {'PETRA images/s':>22}  "
          f"{'backprop images/s':>22}  {'kB/tick per rank':>16}  eth0 / messages")
    print(f"{'':<10} {'':>8} {'':>7}  {'measured  model  start':>22}  "
          f"{'measured  model  start':>22}")
    for (variant, method), ps in sorted(curves(points).items()):
        if method != "petra":
            continue
        for p in ps:
            b, mo = p["pipeline"], p["model"]
            cells = [f"{b[f'{m}_images_per_s']:8.1f} {mo[m]['images_per_s']:6.1f} "
                     f"{mo[m]['images_per_s_startup_costs']:6.1f}" for m in METHODS]
            kb = " ".join(f"{x / 1e3:.0f}" for x in b["petra_sent_bytes_per_tick"])
            ratio = sum(p["eth0_sent_bytes"]) / sum(p["payload_bytes"])
            print(f"{variant:<10} {p['rate']:>8} {gbits(p):7.2f}  {cells[0]:>22}  "
                  f"{cells[1]:>22}  {kb:>16}  {ratio:.3f}")


def summary(p) -> dict:
    """A point's figures for the last line (the whole record is in link_sweep.json)."""
    return {"variant": p["variant"], "rate": p["rate"], "gbits": gbits(p),
            **{f"{m}_images_per_s": p["pipeline"][f"{m}_images_per_s"] for m in METHODS},
            **{f"{m}_model_images_per_s": p["model"][m]["images_per_s"] for m in METHODS},
            "eth0_sent_bytes": p["eth0_sent_bytes"], "payload_bytes": p["payload_bytes"],
            "sent_bytes_per_tick": p["pipeline"]["petra_sent_bytes_per_tick"],
            "model_sent_bytes_per_tick": p["model"]["petra"]["sent_bytes_per_tick"]}


def plot(points, png):
    """images/s against Gbit/s (log x): measured solid, the model dashed; PETRA of each variant
    and uncompressed backprop."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    shown = [(v, m) for (v, m) in sorted(curves(points)) if m == "petra" or v == "plain"]
    for colour, (variant, method) in zip(("C0", "C1", "C2"), shown):
        ps = curves(points)[(variant, method)]
        x = [gbits(p) for p in ps]
        name = "PETRA" if method == "petra" else "backprop"
        ax.plot(x, [p["pipeline"][f"{method}_images_per_s"] for p in ps], "o-", color=colour,
                label=f"{name}, {variant}, measured")
        ax.plot(x, [p["model"][method]["images_per_s"] for p in ps], "--", color=colour,
                label=f"{name}, {variant}, model")
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth, Gbit/s (rightmost: no limit, as measured)")
    ax.set_ylabel("images/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    print(f"wrote {png}")
