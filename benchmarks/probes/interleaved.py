"""Probe: the resident model and offloaded copies of it, forward by forward in turns.

    python3 benchmarks/probes/interleaved.py --preset flux-12b --blocks 19 --px 512 \
        --budgets 100 85 --rounds 40 --json out.json

Each variant is its own copy of the model (the resident one, one with no-op hooks on every
block, one per budget, streamed rank-local), so no variant is applied or removed between timed
forwards: a round runs one forward of each, in an order that turns every round, and a variant's
figure is the median over rounds. Records per forward the GPU time (CUDA events) and the host
time until the call returned (how long the host took to enqueue it: when it is close to the GPU
time, the forward is bound by the host's launches), and one cProfile of each variant's forward.
Then one more offload is applied to a spare copy and removed, and the resident model is timed
right after, to see whether anything left running slows it.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from omni_dist_offload import apply as apply_mod
from omni_dist_offload import layout as layout_mod
from omni_dist_offload import residency as residency_mod
from omni_dist_offload.apply import apply_offload
from omni_dist_offload.budget import MEASURED_FORWARD
from omni_dist_offload.config import OffloadConfig
from omni_dist_offload.layout import layout_block
from omni_dist_offload.models import PRESETS, build_model, case_inputs
from omni_dist_offload.plan import discover
from omni_dist_offload.residency import min_budget


def timed(fn, n):
    gpu, host = [], []
    for _ in range(n):
        if not torch.cuda.is_available():  # a dry run of the probe on the CPU
            t0 = time.perf_counter()
            fn()
            gpu.append((time.perf_counter() - t0) * 1e3)
            host.append(gpu[-1])
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return gpu, host


def module_order_layout(index, name, block, cast=None, per_layer=False):
    """A block's layout with its tensors in module order (the layout before it put the largest
    first), for comparison."""
    new = layout_mod.layout_block(index, name, block, cast, per_layer)
    order = {}
    for mod in block.modules():
        for t in (*mod._parameters.values(), *mod._buffers.values()):
            if t is not None:
                order.setdefault(id(t), len(order))
    offset, entries = 0, []
    for e in sorted(new.entries, key=lambda e: order[id(e.tensor)]):
        entries.append(dataclasses.replace(e, offset=offset))
        offset = layout_mod.align(offset + e.nbytes)
    return dataclasses.replace(new, entries=tuple(entries), nbytes=offset)


def twelfths(sizes, cuts):
    """Partial-plan slot sizes as they were: twelfths of the largest block."""
    return sorted({max(1, int(max(sizes) * k / 12)) for k in range(1, 12)})


OLD = "module"


@contextlib.contextmanager
def old_planner(on):
    """While ``on``: with ``--old-mode module``, module-order layouts and slot sizes in twelfths;
    with ``largest``, largest first with no small tensors ahead of them."""
    if not on:
        yield
        return
    saved = apply_mod.layout_block, residency_mod._partial_caps, layout_mod.TINY_SHARE
    if OLD == "module":
        apply_mod.layout_block, residency_mod._partial_caps = module_order_layout, twelfths
    else:
        layout_mod.TINY_SHARE = 0.0
    try:
        yield
    finally:
        apply_mod.layout_block, residency_mod._partial_caps, layout_mod.TINY_SHARE = saved


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def noop_hooks(model, blocks):
    hook = torch.compiler.disable(lambda *a: None)
    for b in blocks:
        b.register_forward_pre_hook(hook)
        b.register_forward_hook(hook, always_call=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="flux-12b")
    p.add_argument("--blocks", type=int, default=19)
    p.add_argument("--px", type=int, default=512)
    p.add_argument("--budgets", type=float, nargs="*", default=[100, 85])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--old", action="store_true", help="also each budget with an earlier layout (--old-mode)")
    p.add_argument("--old-mode", choices=["module", "largest"], default="module",
                   help="module: module order, slot sizes in twelfths; largest: largest first, no small tensors ahead")
    p.add_argument("--profile-filter", default=None, help="also print the profiled functions matching this regex")
    p.add_argument("--profile-forwards", type=int, default=1, help="forwards per profile")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    global OLD
    OLD = args.old_mode
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    preset = PRESETS[args.preset]
    base = build_model(preset, args.blocks, dev, dtype).eval()
    inputs = case_inputs(preset, base, (args.px,), dev, dtype)
    cfg = {"mode": "layer", "components": ["dit"]}
    (component,) = discover(base, OffloadConfig.parse(cfg))
    sizes = [layout_block(i, n, b).nbytes for i, (n, b) in enumerate(component.blocks)]
    nbytes = sum(sizes)
    models = {"resident": base}
    hooked = copy.deepcopy(base)
    noop_hooks(hooked, [m for _, m in discover(hooked, OffloadConfig.parse(cfg))[0].blocks])
    models["noop-hooks"] = hooked
    handles, old = {}, set()
    for b in args.budgets:
        for was in (False, True) if args.old and b < 100 else (False,):
            m = copy.deepcopy(base)
            name = f"ring@{b:g}%" + ("-old" if was else "")
            with old_planner(was):
                handles[name] = apply_offload(m, {**cfg, "device_budget": max(int(b / 100 * nbytes), min_budget(sizes))},
                                              device=dev)
            models[name] = m
            if was:
                old.add(name)
    out = {"args": vars(args), "gpu_ms": {}, "host_ms": {}, "profile": {}, "after_remove": {}}
    names = list(models)
    with torch.inference_mode():
        ref = base(**inputs)[0]
        for name in names:  # warm up past the planner's measured forward
            with old_planner(name in old):
                for _ in range(3 + MEASURED_FORWARD):
                    y = models[name](**inputs)[0]
            assert torch.equal(y, ref), name
            out["gpu_ms"][name], out["host_ms"][name] = [], []
        for name, h in handles.items():
            (row,) = h.summary_rows()
            ring = h.rings[0]
            costs = dataclasses.asdict(ring.costs) if ring.costs is not None else None
            out.setdefault("plans", {})[name] = {
                "resident": len(row.resident_blocks), "kept": len(row.kept_blocks),
                "slots": ring.num_slots, "predicted_ratio": row.predicted_ratio,
                "plan": dataclasses.asdict(ring.plan) if ring.plan is not None else None, "costs": costs}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            if r % 2:
                order.reverse()
            for name in order:
                # An untimed forward of the same copy first, as a generation runs them: a ring's
                # last blocks prefetch the next forward's first, which the timed forward waits for.
                models[name](**inputs)
                g, hst = timed(lambda: models[name](**inputs), 1)
                out["gpu_ms"][name] += g
                out["host_ms"][name] += hst
        for name in names:
            sync()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.profile_forwards):
                models[name](**inputs)
            prof.disable()
            sync()
            s = io.StringIO()
            stats = pstats.Stats(prof, stream=s).sort_stats("tottime")
            stats.print_stats(18)
            if args.profile_filter:  # e.g. the ring's own functions and the CUDA calls they make
                stats.print_stats(args.profile_filter, 30)
            out["profile"][name] = s.getvalue()
        # Apply and remove one more offload, then time the resident model straight after.
        spare = copy.deepcopy(base)
        g0, h0 = timed(lambda: base(**inputs), 10)
        h = apply_offload(spare, {**cfg, "device_budget": max(int(0.85 * nbytes), min_budget(sizes))}, device=dev)
        for _ in range(3 + MEASURED_FORWARD):
            spare(**inputs)
        sync()
        h.remove()
        del spare, h
        g1, h1 = timed(lambda: base(**inputs), 40)
        out["after_remove"] = {"before_gpu": g0, "before_host": h0, "after_gpu": g1, "after_host": h1}
    rows = []
    for name in names:
        g, hst = out["gpu_ms"][name], out["host_ms"][name]
        rows.append(f"{name:14s} gpu median {statistics.median(g):7.2f} ms  min {min(g):7.2f}  max {max(g):7.2f}  "
                    f"host median {statistics.median(hst):7.2f}  "
                    f"ratio {statistics.median(g) / statistics.median(out['gpu_ms']['resident']):.3f}  "
                    f"paired {statistics.median(a / r for a, r in zip(g, out['gpu_ms']['resident'])):.3f}  "
                    f"predicted {out.get('plans', {}).get(name, {}).get('predicted_ratio') or float('nan'):.3f}")
    print("\n".join(rows))
    ar = out["after_remove"]
    print("resident before apply/remove: gpu", [round(x, 1) for x in ar["before_gpu"]])
    print("resident after remove:        gpu", [round(x, 1) for x in ar["after_gpu"]])
    print("                              host", [round(x, 1) for x in ar["after_host"]])
    for name in names:
        print(f"== profile {name}\n" + "\n".join(out["profile"][name].splitlines()[:30 if not args.profile_filter else 90]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
