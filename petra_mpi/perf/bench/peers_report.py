"""bench peers' table: the run's settings, each contender's images/s with its range over the
rounds and its memory (the fullest rank first), the kept plans, where the time went and every
ratio; then the JSON line."""
from .common import emit
from .waterfall import STEPS

MIB = 2.0 ** 20


def report(a, r):
    """The table on rank 0, then the JSON line (nothing on the other ranks)."""
    if r is None:
        return
    header(a, r)
    contenders(r)
    for name, why in r.get("skipped", {}).items():
        print(f"{name:<31} did not run: {why}")
    kept_plans(r)
    waterfalls(r)
    ratio_lines(r)
    emit(r)


def header(a, r):
    M, net = r["pt_microbatches"], r["model"]
    print(f"width {r['width']}, micro-batch {a.batch}, {r['ranks']} ranks x {r['threads']} "
          f"threads, median (min-max) of {a.rounds} rounds in shuffled order; messages: ours "
          f"over {r['transport']['ours']}, pipelining over {r['transport']['pipelining']}"
          + ("; compiled (torch.compile)" if r["compile"] else ""))
    print(f"ours: {net}, {a.microbatches} micro-batches per timed segment (fill and drain "
          f"included; 'steady': without them), k = {a.accumulation}; pipelining: {M} "
          f"micro-batches per step, {max(1, round(a.microbatches / M))} step(s) per timed "
          f"segment; blocks per stage: ours {r['partition']}, pipelines on {r['plain_model']} "
          f"{r['pt_partition']}, on {net} {r['pt_partition_rev']}; two stages per rank: "
          + ", ".join(f"{n} {s}" for n, s in r["pt_partition_two_per_rank"].items())
          + (f"; layout from {r['layout']}" if r["layout"] else ""))
    flops = r.get("flops_per_microbatch")
    if flops:
        print("GFLOPs per micro-batch (forward + backward): " + ", ".join(
            f"{n} {(f['forward'] + f['backward']) / 1e9:.2f}" for n, f in flops.items()
            if isinstance(f, dict)) + f", PETRA on {net} (rebuild included) "
            f"{flops['petra'] / 1e9:.2f}")


def contenders(r):
    """A row per contender: its net, median images/s (tokens/s), range, steady rate, and peak
    activation MiB on the fullest rank (what a cluster sizes every GPU for) then per rank; a
    single contender's real peak under it."""
    words = "tokens" if "tokens_per_s" in r else "images"
    scale = r["context"] if "tokens_per_s" in r else 1
    print(f"{'contender':<31} {'net':<9} {words + '/s':>9} {'min-max':>15} {'steady':>8}  "
          f"{'fullest':>8}  peak activation MiB per rank")
    rss = r.get("peak_rss_bytes", {})
    for name, rounds in r["images_per_s_rounds"].items():
        held = r["peak_activation_bytes"].get(name)
        per_rank = " ".join(f"{b / MIB:8.2f}" for b in held) if held else ""
        fullest = f"{max(held) / MIB:8.2f}" if held else f"{'':8}"
        still = (f"{r['steady_images_per_s'][name] * scale:8.1f}"
                 if name in r["steady_images_per_s"] else f"{'':8}")
        span = f"{min(rounds) * scale:.1f}-{max(rounds) * scale:.1f}"
        print(f"{name:<31} {r['net'][name]:<9} {r['images_per_s'][name] * scale:>9.1f} "
              f"{span:>15} {still}  {fullest}  {per_rank}")
        if name in rss:
            print(f"{'':<31} real peak (VmHWM) MiB per rank: "
                  + " ".join(f"{b / MIB:.1f}" for b in rss[name]) + " (at start: "
                  + " ".join(f"{b / MIB:.1f}" for b in r["base_rss_bytes"]) + ")")


def kept_plans(r):
    for name, k in r["kept"].items():
        budget = ("no limit" if k["budget_bytes"] is None else "budget " + " ".join(
            f"{b / MIB:.2f}" for b in k["budget_bytes"]) + f" MiB per rank ({k['budget_from']}'s "
            "peak less ours without kept blocks)")
        held = r["peak_kept_bytes"].get(name)
        print(f"{name}: blocks per stage {k['partition']}, kept graphs ({budget}) per stage "
              f"{k['plan']}" + (f", peak kept MiB per rank "
                                f"{' '.join(f'{b / MIB:.2f}' for b in held)}" if held else "")
              + f"; planned time {k['planned_relative_time']:.3f} of PETRA's on its split")


def waterfalls(r):
    if not r.get("waterfall"):
        return
    print("where the time goes, ms per micro-batch on the rank that computes most (the model "
          "at isolated block costs, then what the run adds):")
    print(f"{'contender':<31} {'rank':>4} {'model':>7} {'+compute':>10} {'+waiting':>10} "
          f"{'+framework':>10} {'measured':>9}")
    for name, w in r["waterfall"].items():
        ms = 1e3 / w["microbatches"]
        print(f"{name:<31} {w['rank']:>4} {w['model_s'] * ms:7.2f} " + " ".join(
            f"{w['steps_s'][s_] * ms:+10.2f}" for s_ in STEPS[1:]) + f" {w['wall_s'] * ms:9.2f}")


def ratio_lines(r):
    pairs = r["ratios"]
    if not pairs:
        return
    print("ours / rival, images/s in the same round: median (min-max) of the rounds; ours in "
          "steady state after the semicolon")
    for key, v in pairs.items():
        if key.startswith("steady_"):
            continue
        still = pairs.get("steady_" + key)
        print(f"{key.replace('_vs_', ' / '):<54} {_cell(v)}"
              + (f"; {_cell(still)}" if still else ""))


def _cell(v) -> str:
    return f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})"
