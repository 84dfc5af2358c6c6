import statistics, sys, torch, logging
logging.basicConfig(level=logging.INFO)
from omni_dist_offload import apply_offload
from omni_dist_offload.models import PRESETS, build_model, case_inputs
from omni_dist_offload.layout import layout_block
px = int(sys.argv[1])
dev = torch.device("cuda")
preset = PRESETS["flux-12b"]
model = build_model(preset, 19, dev, torch.bfloat16).eval()
inputs = case_inputs(preset, model, (px,), dev, torch.bfloat16)
blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
nb = [layout_block(i, "b", b).nbytes for i, b in enumerate(blocks)]
def timed(n=15, warm=4):
    for _ in range(warm): model(**inputs)
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); model(**inputs); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
with torch.inference_mode():
    r = timed(); print("resident", r)
    hs = [h for b in blocks for h in (b.register_forward_pre_hook(lambda *a: None), b.register_forward_hook(lambda *a: None))]
    print("noop hooks", timed() / r)
    for h in hs: h.remove()
    print("resident again", timed() / r)
    h = apply_offload(model, {"mode": "layer", "device_budget": sum(nb)})
    print("budget 100%", timed() / r, h.summary()[0]["resident_blocks"])
    h.remove()
    print("resident again", timed() / r)
    for frac in (0.0, 0.75):
        h = apply_offload(model, {"mode": "layer", "device_budget": max(2 * max(nb), int(frac * sum(nb)))})
        for _ in range(3): model(**inputs)
        ring = h.rings[0]; c = ring.costs
        print(f"budget {frac}: measured compute sum {sum(c.compute_ms):.2f} copy sum {sum(c.copy_ms):.2f} pre {c.pre_ms:.2f} post {c.post_ms:.2f} gap {c.gap_ms:.2f} res_ms {c.resident_ms:.2f}")
        print(" compute", [round(x, 2) for x in c.compute_ms]); print(" copy", [round(x, 2) for x in c.copy_ms])
        m = timed()
        print(f" predicted {ring.plan.predicted_ratio:.3f} measured {m / r:.3f} (vs its own res est {m / c.resident_ms:.3f}) resident {ring.plan.resident} slots {ring.num_slots}")
        ring.enable_trace(); model(**inputs); model(**inputs)
        rep = h.trace_report()[0]
        print(" traced fwd", round(rep["forward_ms"], 2), "exposed", round(rep["exposed_wait_ms"], 2), "pre", rep["pre_ms"], "gap", rep["gap_ms"])
        print(" tcompute", [round(b["compute_ms"], 2) for b in rep["blocks"]])
        print(" twait", [round(b["wait_ms"], 2) for b in rep["blocks"]])
        h.remove()
