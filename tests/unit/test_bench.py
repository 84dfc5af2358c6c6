"""The benchmark on CPU: variants and their order, reported fields, JSON, charts, the peer's undo,
the CLI subcommand. The figures that matter come from GPUs; these check that a run completes and
reports every field. The torchrun wrapper: dist/test_bench_torchrun.py; on CUDA: gpu/test_gpu_bench.py."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest
import torch

from omni_dist_offload.tools import bench
from omni_dist_offload.tools.bench import CaseResult, PeerOffload, floor_ms, schedule
from omni_dist_offload.models import PRESETS, build_model, flux_inputs
from omni_dist_offload.plan import module_bytes
from omni_dist_offload.app.cli import main as cli_main
from faults import nudged_outputs
from media import png_size

TINY_WAN = ["--preset", "tiny-wan", "--frames", "5", "--height", "32", "--width", "32",
            "--warmup", "1", "--repeats", "2"]
FIELDS = {f.name for f in dataclasses.fields(CaseResult)}


def test_schedule_is_mirrored_with_resident_first_and_last() -> None:
    assert schedule(bench.DEFAULT_VARIANTS, world=1) == [
        "resident", "peer", "rank-local", "rank-local", "peer", "resident"]
    assert schedule(bench.DEFAULT_VARIANTS, world=2) == [
        "resident", "peer", "rank-local", "allgather", "allgather", "rank-local", "peer", "resident"]
    first = ["peer", "rank-local", "shared", "allgather", "allgather-nccl", "compiled", "compiled-streamed",
             "fp8-resident", "fp8-streamed", "fp8-allgather", "fp8-layer", "fp8-allgather-layer"]
    assert schedule(bench.VARIANTS, world=2) == ["resident", *first, *reversed(first), "resident"]
    # Multi-rank variants drop out on one rank.
    one = ["peer", "rank-local", "compiled", "compiled-streamed", "fp8-resident", "fp8-streamed", "fp8-layer"]
    assert schedule(bench.VARIANTS, world=1) == ["resident", *one, *reversed(one), "resident"]
    # The order is fixed whatever order the flags name them in.
    assert schedule(["allgather", "rank-local"], world=2) == [
        "resident", "rank-local", "allgather", "allgather", "rank-local", "resident"]
    assert schedule([], world=1) == ["resident", "resident"]


def test_floor_replaces_each_blocks_compute_by_its_link_time_when_longer() -> None:
    # 1 GB/s: block 0 (2 ms compute, 5 MB = 5 ms) is link-bound, block 1 (4 ms, 1 MB) is not.
    assert floor_ms(10.0, [2.0, 4.0], [5_000_000, 1_000_000], 1e9) == pytest.approx(13.0)
    assert floor_ms(10.0, [2.0, 4.0], [5_000_000, 1_000_000], 1e9, share=2) == pytest.approx(10.5)
    assert floor_ms(10.0, [2.0, 4.0], [5_000_000, 1_000_000], None) == 10.0  # CPU: no link


def test_cli_bench_tiny_wan_reports_every_field_json_and_png(tmp_path, capsys) -> None:
    # Into a folder that is not there yet, as docs/performance.md's CPU smoke run writes out/.
    out_json, out_png = tmp_path / "out" / "bench.json", tmp_path / "out" / "charts" / "overhead.png"
    assert cli_main(["bench", *TINY_WAN, "--json", str(out_json), "--png", str(out_png)]) == 0
    table = capsys.readouterr().out
    assert all(f" {v} " in table for v in ("resident", "peer", "rank-local"))
    assert "use_stream=False" in table  # the peer runs without streams on the CPU, and says so

    data = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in data["results"]}
    assert list(rows) == ["resident", "peer", "rank-local"] and len(data["results"]) == 3
    for row in data["results"]:
        assert set(row) == FIELDS
        assert row["forward_ms"] > 0 and row["floor_ms"] > 0 and isinstance(row["bitwise_equal"], bool)
        assert len(row["timings_ms"]) == 2 * 2  # two passes of --repeats 2
        # One rank: its raw timings are the only rank's, and the figure is their median.
        assert row["timings_ms_per_rank"] == [row["timings_ms"]]
        assert row["forward_ms"] == statistics.median(row["timings_ms"])
        assert row["peak_device_mib"] == 0.0  # no device memory on the CPU
    assert rows["resident"]["overhead"] == 1.0 and rows["resident"]["host_mib"] == 0.0
    assert rows["rank-local"]["bitwise_equal"] and rows["resident"]["bitwise_equal"]
    assert rows["rank-local"]["weight_transfer"] == "rank-local"
    assert rows["peer"]["weight_transfer"] == "group-offload"
    model_mib = module_bytes(build_model(PRESETS["tiny-wan"], 4, torch.device("cpu"), torch.float32)) / 2**20
    assert rows["peer"]["host_mib"] == pytest.approx(model_mib)  # the peer keeps the whole model
    assert 0 < rows["rank-local"]["host_mib"] < model_mib  # only the blocks
    assert rows["peer"]["setup_s"] > 0 and rows["rank-local"]["setup_s"] > 0
    for row in data["results"]:  # the CPU has no link: every floor is the resident time
        assert row["floor_ms"] == rows["resident"]["forward_ms"]
    meta = data["meta"]
    assert meta["schedule"][0] == meta["schedule"][-1] == "resident"
    assert meta["device"] == "cpu" and meta["peer"]["use_stream"] is False
    assert "max over ranks r of median(timings_ms_per_rank[r])" in meta["figures"]["forward_ms"]
    assert png_size(out_png)[0] > 100


def test_module_entry_runs_block_counts_and_sizes_as_cases(tmp_path, capsys) -> None:
    out_json = tmp_path / "flux.json"
    argv = ["--preset", "tiny-flux", "--blocks", "2", "4", "--px", "32", "--variants", "rank-local",
            "--warmup", "1", "--repeats", "1", "--json", str(out_json)]
    assert bench.main(argv, prog="python -m omni_dist_offload.bench") == 0
    results = json.loads(out_json.read_text())["results"]
    assert [(r["blocks"], r["shape"], r["variant"]) for r in results] == [
        (2, "32", "resident"), (2, "32", "rank-local"), (4, "32", "resident"), (4, "32", "rank-local")]
    assert all(r["bitwise_equal"] for r in results)


def test_peer_offload_is_undone_to_a_bitwise_equal_resident_model() -> None:
    model = build_model(PRESETS["tiny-flux"], 3, torch.device("cpu"), torch.float32)
    inputs = flux_inputs(model, 32, torch.device("cpu"), torch.float32, text_tokens=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        reference = model(**inputs)[0]
        peer = PeerOffload(model, torch.device("cpu"))
        assert peer.host_bytes() == module_bytes(model)
        assert torch.equal(model(**inputs)[0], reference)
        peer.remove()
        after = model.state_dict()
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert peer._groups() == []  # no group-offloading hook left anywhere
        assert torch.equal(model(**inputs)[0], reference)


def test_timeline_png_from_a_traced_run(tmp_path, capsys) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "timeline.png"
    argv = [*TINY_WAN, "--variants", "rank-local", "--json", str(out_json), "--timeline", str(out_png)]
    assert bench.main(argv) == 0
    timeline = json.loads(out_json.read_text())["timeline"]
    assert timeline["variant"] == "rank-local" and timeline["case"] == "tiny-wan 4b 5x32x32"
    (ring,) = timeline["rings"]
    assert [b["index"] for b in ring["blocks"]] == [0, 1, 2, 3]
    assert all(b["compute_ms"] >= 0 and b["bytes"] > 0 for b in ring["blocks"])
    assert png_size(out_png)[0] > 100


def test_draw_timeline_from_a_report(tmp_path) -> None:
    from omni_dist_offload.tools.timeline import draw_timeline

    blocks = [{"index": i, "name": f"blocks.{i}", "bytes": 1 << 20, "compute_start_ms": 2.0 * i + 0.5 * (i == 2),
               "compute_ms": 1.5, "wait_ms": 0.5 if i == 2 else 0.0,
               "transfer_start_ms": 2.0 * i - 1.8, "transfer_ms": 1.6, "gbps": 0.66} for i in range(4)]
    blocks[1].update(transfer_start_ms=None, transfer_ms=None, gbps=None)  # not refilled
    report = [{"component": "transformer", "forward_ms": 8.0, "exposed_wait_ms": 0.5,
               "exposed_share": 0.0625, "blocks": blocks}]
    path = draw_timeline(report, tmp_path / "t.png", title="synthetic")
    assert png_size(path)[0] > 100
    with pytest.raises(ValueError, match="no rings"):
        draw_timeline([], tmp_path / "empty.png")


@pytest.mark.parametrize("flags, message", [
    (["--variants", "resident"], "invalid choice"),
    (["--preset", "tiny-wan", "--height", "30"], "multiples of 16"),
    (["--timeline-variant", "allgather"], "needs --timeline"),
    (["--repeats", "0"], "not a positive integer"),
    (["--budget", "120"], "a percentage is from 0 to 100"),
    (["--budget", "lots"], "give a percentage of the block bytes"),
    (["--budget", "50", "50%"], "each budget once"),
    (["--cache", "first-block:0.1"], "give --steps 2 or more"),
    (["--cache", "warp", "--steps", "4"], "unknown step cache 'warp'"),
    (["--interleave", "--ulysses-degree", "2"], "which --ulysses-degree/--ring-degree does not allow"),
    (["--interleave", "--steps", "3", "--cache", "first-block:0.1"], "which --cache does not allow"),
    (["--chunk-mib", "-5"], "argument --chunk-mib: '-5' is negative"),
    (["--chunk-mib", "16", "nan"], "argument --chunk-mib: 'nan' is not a finite number"),
    (["--transfer-mib", "0"], "argument --transfer-mib: '0' is not above 0"),
    (["--png", "out.png", "--timeline", "./out.png"], "--png and --timeline name the same file ('out.png')"),
    (["--json", "out.png", "--png", "out.png"], "--json and --png name the same file"),
    (["--transfer-mib", "inf"], "argument --transfer-mib: 'inf' is not a finite number"),
    (["--ulysses-degree", "2", "--cache", "first-block:0.2", "--steps", "2"], "--cache first-block with --ulysses-degree 2"),
])
def test_bad_flags_exit_2_with_one_line(flags, message, capsys) -> None:
    assert cli_main(["bench", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("omni-offload bench: error:") and message in err[0]


def test_budget_sweep_runs_each_budget_and_reports_the_plan(tmp_path, capsys) -> None:
    out_json = tmp_path / "budget.json"
    flags = ["--preset", "tiny-flux", "--px", "32", "--warmup", "1", "--repeats", "2", "--variants",
             "rank-local", "--budget", "0", "60", "100", "--json", str(out_json)]
    assert cli_main(["bench", *flags]) == 0
    text = capsys.readouterr().out
    assert "pred x" in text and "0% is below two slots of the largest block" in text
    rows = {r["variant"]: r for r in json.loads(out_json.read_text())["results"]}
    assert list(rows) == ["resident", "rank-local@0%", "rank-local@60%", "rank-local@100%"]
    assert all(r["bitwise_equal"] for r in rows.values())
    assert rows["rank-local@100%"]["resident_blocks"] == 5 and rows["rank-local@100%"]["predicted_ratio"] == 1.0
    assert rows["rank-local@0%"]["resident_blocks"] == 0 and rows["rank-local@0%"]["slots"] == 2
    # Once planned from a measured forward, every budget below 100% predicts its ratio.
    assert rows["rank-local@60%"]["predicted_ratio"] is not None
    # What each forward copies: nothing once every block is resident (here 60% is below two
    # slots and runs as 0% does).
    streamed = [rows[f"rank-local@{b}%"]["streamed_mib"] for b in (0, 60, 100)]
    assert streamed[0] == streamed[1] > streamed[2] == 0 and rows["resident"]["streamed_mib"] == 0
    assert schedule(["peer", "rank-local"], 1, [bench.Budget.parse("0"), bench.Budget.parse("50")]) == [
        "resident", "peer", "rank-local@0%", "rank-local@50%", "rank-local@50%", "rank-local@0%", "peer",
        "resident"]


def test_interleaved_variants_run_side_by_side_and_ratios_pair_rounds(tmp_path, capsys) -> None:
    out_json = tmp_path / "interleaved.json"
    flags = ["--preset", "tiny-flux", "--px", "32", "--warmup", "1", "--repeats", "5", "--interleave",
             "--variants", "peer", "rank-local", "fp8-resident", "fp8-streamed", "--budget", "0", "100",
             "--json", str(out_json)]
    assert cli_main(["bench", *flags]) == 0
    doc = json.loads(out_json.read_text())
    assert doc["meta"]["interleave"] is True
    # No passes ran, so no schedule of them; the budget variants' extra warm-up is said.
    assert doc["meta"]["schedule"] is None and doc["meta"]["extra_warmup_under_a_budget"] == 2
    rows = {r["variant"]: r for r in doc["results"]}
    assert list(rows) == ["resident", "peer", "rank-local@0%", "rank-local@100%", "fp8-resident",
                          "fp8-streamed@0%", "fp8-streamed@100%"]
    assert all(r["bitwise_equal"] for r in rows.values()) and all(len(r["timings_ms"]) == 5 for r in rows.values())
    assert all(r["timings_ms_per_rank"] == [r["timings_ms"]] for r in rows.values())
    assert "median over rounds" in doc["meta"]["figures"]["overhead"]
    # A ratio is the median over rounds of the forward over the baseline's of the same round.
    res, fp8 = rows["resident"]["timings_ms"], rows["fp8-resident"]["timings_ms"]
    for name, row in rows.items():
        assert row["overhead"] == pytest.approx(statistics.median(a / b for a, b in zip(row["timings_ms"], res)))
        if name.startswith("fp8-streamed"):
            assert row["vs_fp8"] == pytest.approx(statistics.median(a / b for a, b in zip(row["timings_ms"], fp8)))
    assert rows["rank-local@0%"]["host_mib"] > 0 and rows["rank-local@100%"]["resident_blocks"] == 5
    # The chart's bar (overhead) over its floor tick (floor_overhead) is the table's x floor
    # (to_floor = forward_ms / floor_ms); the tick was floor_ms / the resident forward_ms, a ratio
    # of medians beside a median of ratios, so a variant could sit below its own floor.
    for row in rows.values():
        assert row["to_floor"] == pytest.approx(row["forward_ms"] / row["floor_ms"])
        assert row["overhead"] / row["floor_overhead"] == pytest.approx(row["to_floor"])
    assert "floor_overhead" in doc["meta"]["figures"]
    # A --budget percent is of the blocks' bytes as the ring lays them out (alignment included).
    assert rows["rank-local@100%"]["device_budget"] == pytest.approx(rows["rank-local@100%"]["block_mib"] * 2**20)


def test_compiled_variants_compare_with_the_compiled_resident_model(tmp_path) -> None:
    out_json = tmp_path / "compiled.json"
    flags = ["--preset", "tiny-flux", "--px", "32", "--warmup", "1", "--repeats", "2", "--variants",
             "compiled", "compiled-streamed", "--budget", "0", "100", "--json", str(out_json)]
    assert cli_main(["bench", *flags]) == 0
    rows = {r["variant"]: r for r in json.loads(out_json.read_text())["results"]}
    assert list(rows) == ["resident", "compiled", "compiled-streamed@0%", "compiled-streamed@100%"]
    assert all(r["bitwise_equal"] for r in rows.values())  # compiled ones against compiled resident
    assert rows["compiled"]["compile_s"] > 0 and rows["compiled"]["vs_compiled"] is None
    assert rows["compiled-streamed@0%"]["vs_compiled"] > 0 and rows["compiled-streamed@0%"]["slots"] == 2


def test_lora_flags(capsys):
    from omni_dist_offload.tools.bench import main

    assert main(["--preset", "tiny-wan", "--lora-fused"]) == 2
    assert "--lora-fused fuses the adapter --lora RANK adds" in capsys.readouterr().err


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_a_lora_case_streams_bitwise_equal(fused, tmp_path):
    from omni_dist_offload.tools.bench import main

    out = tmp_path / "lora.json"
    argv = ["--preset", "tiny-wan", "--frames", "5", "--height", "32", "--width", "32", "--variants",
            "rank-local", "--lora", "4", "--warmup", "0", "--repeats", "1", "--json", str(out)]
    assert main(argv + (["--lora-fused"] if fused else [])) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["lora"]["rank"] == 4 and data["meta"]["lora"]["fused"] is fused
    assert all(r["bitwise_equal"] for r in data["results"])


def test_a_cached_denoising_loop_streams_bitwise_equal_and_reports_the_steps_it_ran(tmp_path):
    from omni_dist_offload.tools.bench import main

    out = tmp_path / "cache.json"
    argv = ["--preset", "tiny-wan", "--frames", "5", "--height", "32", "--width", "32", "--variants",
            "rank-local", "--steps", "8", "--cache", "first-block:0.2", "--warmup", "0", "--repeats", "1",
            "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["steps"] == 8 and data["meta"]["cache"]["type"] == "first-block"
    assert all(1 <= r["computed_steps"] < 8 for r in data["results"])  # the cache skipped steps
    assert all(r["bitwise_equal"] for r in data["results"])
    assert all(r["floor_ms"] == data["results"][0]["forward_ms"] for r in data["results"])  # the resident loop


@pytest.mark.parametrize(("flags", "message"), [
    (["--ulysses-degree", "2", "--variants", "peer", "rank-local"], "the peer (diffusers group offloading) does not run"),
    (["--ulysses-degree", "2", "--stagger"], "leave out one of them"),
    (["--ulysses-degree", "0"], "is not a positive integer"),
    (["--ulysses-degree", "2"], "needs torch.distributed"),  # one process: no ranks to split over
])
def test_context_parallel_flags_are_checked_before_any_model(flags, message, capsys):
    assert bench.main(["--preset", "tiny-wan", "--frames", "5", "--height", "32", "--width", "32", *flags]) == 2
    assert message in capsys.readouterr().err



@pytest.mark.parametrize(("flags", "words"), [
    (["--preset", "tiny-wan", "--frames", "5", "--height", "48", "--width", "48", "--ulysses-degree", "3"],
     ("--ulysses-degree 3: tiny-wan's DiT (WanTransformer3DModel) has 2 attention heads, which 3 does not divide",
      "pick a --ulysses-degree that divides 2 (1 or 2)", "--ring-degree")),
    (["--preset", "wan-14b", "--ulysses-degree", "3"], ("40 attention heads", "(1, 2, 4, 5, 8, 10, 20 or 40)")),
    (["--preset", "tiny-wan", "--frames", "5", "1", "--height", "48", "--width", "48", "--ulysses-degree", "2"],
     ("--frames 1 --height 48 --width 48 (one case of --frames 5 1) with --ulysses-degree 2 --ring-degree 1:",
      "has 9 tokens, which 2 does not divide", "pick --frames/--height/--width whose token count 2 divides "
      "(e.g. --height 64), or --ulysses-degree/--ring-degree whose product divides 9")),
    (["--preset", "tiny-wan", "--frames", "9", "--height", "48", "--width", "80", "--ulysses-degree", "2"],
     ("--frames 9 --height 48 --width 80 with", "has 45 tokens", "e.g. --height 64")),  # 3 x 3 x 5 patches
    (["--preset", "tiny-flux", "--px", "48", "--ulysses-degree", "2"],
     ("--px 48 with --ulysses-degree 2 --ring-degree 1:", "9 tokens", "pick --px whose token count 2 divides "
      "(e.g. --px 64)")),
    (["--preset", "wan-14b", "--frames", "81", "--height", "720", "--width", "1264", "--ulysses-degree", "4"],
     ("74655 tokens, which 4 does not divide", "e.g. --height 704")),  # 21 x 45 x 79 latent patches
    (["--preset", "odd-text", "--px", "64", "--ulysses-degree", "2"],
     ("also splits the prompt's text embedding across 2 ranks, and the preset's has 7 tokens",
      "no size flag changes: pick --ulysses-degree/--ring-degree whose product divides 7")),
], ids=["heads", "heads 14b", "uneven video", "uneven frames", "uneven image", "uneven 14b", "uneven text"])
def test_splits_the_degrees_cannot_make_are_refused_before_any_model(flags, words, monkeypatch, capsys) -> None:
    """``--ulysses-degree``/``--ring-degree`` with heads the Ulysses degree does not divide, or a
    case whose tokens (or text) the context-parallel size does not divide: one line, exit 2, read
    from the preset's DiT on the meta device, before any model is built or the job's ranks are
    checked (the split refused them only at the first forward, a traceback on every rank)."""
    import dataclasses

    monkeypatch.setitem(PRESETS, "odd-text", dataclasses.replace(PRESETS["tiny-flux"], text_tokens=7))
    monkeypatch.setattr(bench, "build_model", lambda *a, **k: pytest.fail("built a model"))
    assert bench.main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("omni-offload bench: error: "), err
    for word in words:
        assert word in err[0], err[0]


@pytest.mark.parametrize("flags", [
    ["--preset", "tiny-wan", "--frames", "5", "9", "--height", "32", "--width", "32", "--ulysses-degree", "2"],
    ["--preset", "tiny-wan", "--frames", "1", "--height", "48", "--width", "64", "--ulysses-degree", "2"],
    ["--preset", "tiny-flux", "--px", "32", "64", "--ulysses-degree", "2"],
    ["--preset", "wan-14b", "--ulysses-degree", "4"],  # the defaults: 81 and 17 frames at 480 x 832
    ["--preset", "flux-12b", "--ulysses-degree", "8"],
])
def test_splits_the_degrees_make_pass_the_check(flags) -> None:
    args = bench.build_parser().parse_args(flags)
    bench._check_args(args)  # no refusal (one process: the run would then ask for torchrun's ranks)
    assert args.context_parallel is not None


def test_contention_refuses_a_run_it_cannot_time(capsys) -> None:
    from omni_dist_offload.tools import contention

    assert contention.main(["--modes", "spread"]) == 2  # every mode is read against the model alone
    assert "--modes must include alone" in capsys.readouterr().err
    if not torch.cuda.is_available():  # a usage error: one line, exit 2, as bench --transfer-mib
        assert contention.main(["--preset", "tiny-flux", "--blocks", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no CUDA device is visible" in err[0]


def test_an_8_bit_budget_below_its_ring_minimum_runs_at_that_minimum(tmp_path) -> None:
    # Two slots and two staging buffers: more than two slots of the largest block in bf16.
    out_json = tmp_path / "fp8.json"
    flags = ["--preset", "tiny-flux", "--px", "32", "--warmup", "1", "--repeats", "1", "--variants",
             "fp8-resident", "fp8-streamed", "fp8-layer", "--budget", "0", "60", "--json", str(out_json)]
    assert cli_main(["bench", *flags]) == 0
    rows = {r["variant"]: r for r in json.loads(out_json.read_text())["results"]}
    row = rows["fp8-streamed@0%"]
    assert row["bitwise_equal"] and "below two slots" in row["note"] and row["slots"] == 2
    # upcast "layer": the minimum is two slots of the largest block in 8 bits, and a budget
    # holds more than "block" does.
    layer, block = rows["fp8-layer@0%"], rows["fp8-layer@60%"]
    assert layer["bitwise_equal"] and "below two slots" in layer["note"] and layer["device_budget"] < row["device_budget"]
    assert block["bitwise_equal"] and block["vs_fp8"] is not None
    assert rows["fp8-layer@60%"]["streamed_mib"] < rows["fp8-streamed@60%"]["streamed_mib"]


# -- output paths, checked before any model ---------------------------------------------------
@pytest.fixture
def no_run(monkeypatch):
    """bench.main up to the run: the flags checked, nothing built; what the run would see."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def run(args, *_rest):
        seen["args"] = args
        return 0

    monkeypatch.setattr(bench, "_run", run)
    return seen


def test_missing_output_folders_are_made_before_the_run(tmp_path, no_run) -> None:
    paths = {flag: tmp_path / "out" / flag / f"x.{suffix}" for flag, suffix in (("json", "json"), ("png", "png"),
                                                                                  ("timeline", "svg"))}
    argv = [*TINY_WAN, *(a for flag, path in paths.items() for a in (f"--{flag}", str(path)))]
    assert bench.main(argv) == 0
    assert "args" in no_run and all(path.parent.is_dir() and not path.exists() for path in paths.values())


@pytest.mark.parametrize("flag", ["--json", "--png", "--timeline"])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_model(flag, tmp_path, capsys, no_run) -> None:
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "out" / "x"
    assert cli_main(["bench", *TINY_WAN, flag, str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"omni-offload bench: error: {flag} '{path}': cannot create its folder")
    assert f"'{tmp_path / 'file'}' is a file" in err[0] and "args" not in no_run


@pytest.fixture
def home(tmp_path, monkeypatch):
    """HOME in tmp_path, run from another folder there: a literal ~ would be a ./~ folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path / "home"


@pytest.mark.parametrize("form", ["--{flag}=~/{path}", "--{flag} ~/{path}"])
def test_output_paths_expand_a_tilde_as_they_are_parsed(form, home) -> None:
    paths = {"json": "r/x.json", "png": "r/x.png", "timeline": "r/t.svg"}
    args = bench.build_parser().parse_args([a for flag, path in paths.items()
                                            for a in form.format(flag=flag, path=path).split(" ")])
    assert {flag: getattr(args, flag) for flag in paths} == {flag: home / path for flag, path in paths.items()}


def test_the_json_lands_where_a_tilde_points_after_the_run(home, monkeypatch, capsys) -> None:
    """Checked expanded before the run, --json=~/x.json was written as given after it: the
    whole run, then FileNotFoundError '~/x.json' and the results lost."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(bench, "measure_case", lambda *_args: bench.CaseRun(results=[]))  # no model: the write is what counts
    assert cli_main(["bench", *TINY_WAN, "--json=~/res/x.json"]) == 0
    data = json.loads((home / "res" / "x.json").read_text())
    assert data["results"] == [] and data["meta"]["argv"][-1] == "--json=~/res/x.json"
    assert list(Path.cwd().iterdir()) == []  # no ./~ folder


def test_bad_flags_create_no_output_folder(tmp_path, capsys, no_run) -> None:
    out = tmp_path / "out" / "bench.json"
    assert bench.main([*TINY_WAN, "--height", "30", "--json", str(out)]) == 2
    assert not out.parent.exists() and "multiples of 16" in capsys.readouterr().err


def test_stagger_on_one_rank_says_it_changes_nothing(capsys, no_run) -> None:
    assert bench.main([*TINY_WAN, "--stagger"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("omni-offload bench: note: --stagger") and "one rank" in err[0]
    assert bench.main(TINY_WAN) == 0 and capsys.readouterr().err == ""


# -- the overhead chart ------------------------------------------------------------------------
def _drawn(monkeypatch, variants, tmp_path):
    """draw_overhead on one case with a row per variant: the figure it drew."""
    from omni_dist_offload.tools import timeline

    figures = []
    make = timeline._figure
    monkeypatch.setattr(timeline, "_figure", lambda *a, **k: figures.append(make(*a, **k)) or figures[-1])
    rows = [CaseResult(preset="tiny-wan", blocks=4, shape="5x32x32", variant=v, forward_ms=10.0 + i,
                       overhead=1.0 + 0.1 * i, floor_ms=10.0, peak_device_mib=0, host_mib=0, setup_s=0,
                       bitwise_equal=True) for i, v in enumerate(["resident", *variants])]
    path = timeline.draw_overhead(rows, tmp_path / "overhead.png", title="t")
    assert png_size(path)[0] > 100
    (fig,) = figures
    (ax,) = fig.axes
    legends = [ax.get_legend()] if ax.get_legend() else fig.legends
    labels = [t.get_text() for legend in legends for t in legend.get_texts()]
    colors = [tuple(p.get_facecolor()) for p in ax.patches]
    return ax, labels, colors


def test_the_overhead_chart_draws_every_variant_that_ran(monkeypatch, tmp_path) -> None:
    ax, labels, colors = _drawn(monkeypatch, bench.VARIANTS, tmp_path)
    assert labels == list(bench.VARIANTS)  # in the run's order, resident left out
    assert len(ax.patches) == len(bench.VARIANTS) and len(set(colors)) == len(bench.VARIANTS)
    # Only variants without a fixed colour, e.g. fp8 alone: drawn, not an empty chart.
    ax, labels, _ = _drawn(monkeypatch, ["fp8-resident", "fp8-streamed"], tmp_path)
    assert labels == ["fp8-resident", "fp8-streamed"] and len(ax.patches) == 2


def test_the_overhead_chart_keeps_its_look_for_the_default_variants(monkeypatch, tmp_path) -> None:
    from matplotlib.colors import to_rgba

    ax, labels, colors = _drawn(monkeypatch, ["peer", "rank-local", "allgather"], tmp_path)
    assert ax.get_legend() is not None and labels == ["peer", "rank-local", "allgather"]
    assert colors == [to_rgba(c) for c in ("#9e9e9e", "#1f77b4", "#2ca02c")]


# -- refused before anything runs ------------------------------------------------------------
@pytest.mark.parametrize("flag, name", [("--png", "chart.txt"), ("--timeline", "tl.dat"), ("--png", "c.jpeg2")])
def test_a_chart_path_matplotlib_cannot_write_is_refused_before_any_model(flag, name, tmp_path, capsys, no_run) -> None:
    path = tmp_path / "out" / name
    assert cli_main(["bench", *TINY_WAN, "--variants", "rank-local", flag, str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"omni-offload bench: error: {flag} '{path}': matplotlib cannot write")
    assert ".png" in err[0] and ".svg" in err[0] and "args" not in no_run and not path.parent.exists()
    # A suffix matplotlib writes, in any case, or none (matplotlib writes PNG): taken.
    for good in ("chart", "chart.SVG", "chart.pdf"):
        assert bench.main([*TINY_WAN, "--variants", "rank-local", flag, str(tmp_path / good)]) == 0
    assert "args" in no_run


@pytest.mark.parametrize("flags, names", [
    (["--timeline", "{tmp}/t.png", "--timeline-variant", "allgather"], "--timeline-variant allgather needs torchrun"),
    (["--timeline", "{tmp}/t.png", "--timeline-variant", "allgather-nccl"], "--timeline-variant allgather-nccl needs"),
    (["--variants", "allgather"], "--variants allgather: needs torchrun with 2 or more ranks"),
    (["--variants", "rank-local", "shared", "fp8-allgather"], "--variants shared fp8-allgather: need torchrun"),
])
def test_multi_rank_variants_in_one_process_are_refused_before_any_model(flags, names, tmp_path, capsys, no_run,
                                                                         monkeypatch) -> None:
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert bench.main([*TINY_WAN, *flags, "--json", str(tmp_path / "out" / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("omni-offload bench: error: ") and names in err[0]
    assert "args" not in no_run and not (tmp_path / "out").exists()
    # Under torchrun with two ranks the same flags pass (rank 1: it checks no output path).
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    bench._check_args(bench.build_parser().parse_args([*TINY_WAN, *flags]))


def test_a_run_refused_outside_torchrun_leaves_no_output_folder(tmp_path, capsys) -> None:
    out = tmp_path / "left" / "x.json"
    assert bench.main([*TINY_WAN, "--ulysses-degree", "2", "--json", str(out)]) == 2
    assert "needs torch.distributed" in capsys.readouterr().err and not out.parent.exists()


def test_the_budget_sweep_draws_a_line_per_variant_at_its_share_of_the_block_bytes(monkeypatch, tmp_path) -> None:
    """Rows of two variants at 40% and 60% were drawn as one zig-zag line at 66.7% and 100% (x
    was scaled by the largest budget, rows grouped by case alone)."""
    from omni_dist_offload.tools import timeline

    figures = []
    make = timeline._figure
    monkeypatch.setattr(timeline, "_figure", lambda *a, **k: figures.append(make(*a, **k)) or figures[-1])
    block = 100 * 2**20

    def row(variant, share, overhead):
        return CaseResult(preset="flux-12b", blocks=4, shape="1024", variant=variant, forward_ms=10.0 * overhead,
                          overhead=overhead, floor_ms=10.0, peak_device_mib=0, host_mib=0, setup_s=0,
                          bitwise_equal=True, device_budget=int(share * block) if share else None,
                          block_mib=block / 2**20)

    rows = [row("resident", None, 1.0), row("rank-local@40", 0.4, 1.5), row("fp8-streamed@40", 0.4, 1.2),
            row("rank-local@60", 0.6, 1.1), row("fp8-streamed@60", 0.6, 1.0)]
    path = timeline.draw_budget_sweep(rows, tmp_path / "sweep", title="t")  # no suffix: PNG, this very path
    assert path == tmp_path / "sweep" and png_size(path)[0] > 100 and not (tmp_path / "sweep.png").exists()
    (ax,) = figures[0].axes
    measured = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()
                if line.get_label().endswith(": measured")}
    assert measured == {"flux-12b 4b 1024 rank-local: measured": ([40.0, 60.0], [1.5, 1.1]),
                        "flux-12b 4b 1024 fp8-streamed: measured": ([40.0, 60.0], [1.2, 1.0])}


def _staggered(variant, rank, overhead, share=None, block=100 * 2**20):
    """A --stagger row: one rank's own figures of a case."""
    return CaseResult(preset="flux-12b", blocks=4, shape="1024", variant=variant, forward_ms=10.0 * overhead,
                      overhead=overhead, floor_ms=10.0, peak_device_mib=0, host_mib=0, setup_s=0,
                      bitwise_equal=True, device_budget=int(share * block) if share else None,
                      block_mib=block / 2**20, rank=rank)


def test_stagger_charts_draw_every_ranks_rows(monkeypatch, tmp_path) -> None:
    """--stagger rows (two ranks, same case and variant) were keyed by case and variant alone:
    the overhead chart drew one bar per variant (the last rank's), the budget sweep one line
    zig-zagging through both ranks' points."""
    from omni_dist_offload.tools import timeline

    figures = []
    make = timeline._figure
    monkeypatch.setattr(timeline, "_figure", lambda *a, **k: figures.append(make(*a, **k)) or figures[-1])
    rows = [_staggered("resident", 0, 1.0), _staggered("resident", 1, 1.0),
            _staggered("rank-local", 0, 1.5), _staggered("rank-local", 1, 2.5)]
    timeline.draw_overhead(rows, tmp_path / "overhead.png")
    (ax,) = figures[0].axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["flux-12b 4b 1024 r0", "flux-12b 4b 1024 r1"]
    assert sorted(p.get_height() for p in ax.patches) == [1.5, 2.5]

    rows = [_staggered("resident", 0, 1.0), _staggered("resident", 1, 1.0),
            _staggered("rank-local@40", 0, 1.5, 0.4), _staggered("rank-local@40", 1, 2.5, 0.4),
            _staggered("rank-local@60", 0, 1.1, 0.6), _staggered("rank-local@60", 1, 2.1, 0.6)]
    timeline.draw_budget_sweep(rows, tmp_path / "sweep.png")
    (ax,) = figures[1].axes
    measured = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()
                if line.get_label().endswith(": measured")}
    assert measured == {"flux-12b 4b 1024 r0 rank-local: measured": ([40.0, 60.0], [1.5, 1.1]),
                        "flux-12b 4b 1024 r1 rank-local: measured": ([40.0, 60.0], [2.5, 2.1])}


# -- LoRA with the fp8 baseline, Ctrl-C, flags taken and then unused ----------------------------
def test_the_fp8_baseline_undo_leaves_a_lora_model_without_hooks() -> None:
    """enable_layerwise_casting also hooks each LoRA layer (peft_autocast_disable); the undo left
    those on, and the next fp8-resident pass failed: 'Hook with name peft_autocast_disable
    already exists'."""
    model = build_model(PRESETS["tiny-flux"], 2, torch.device("cpu"), torch.float32).eval()
    bench.add_lora(model, 4, fused=False)
    inputs = flux_inputs(model, 32, torch.device("cpu"), torch.float32, text_tokens=8)
    with torch.inference_mode():
        reference = model(**inputs)[0]
        for _ in range(2):  # the second pass starts from the model the first undo left
            undo = bench.layerwise_casting(model)
            model(**inputs)
            undo()
            assert [n for n, m in model.named_modules() if hasattr(m, "_diffusers_hook") or "forward" in vars(m)] == []
        assert torch.equal(model(**inputs)[0], reference)


def test_a_lora_case_runs_the_fp8_baseline(tmp_path) -> None:
    out = tmp_path / "lora-fp8.json"
    argv = ["--preset", "tiny-flux", "--px", "32", "--blocks", "2", "--lora", "4", "--variants", "fp8-resident",
            "fp8-streamed", "--warmup", "0", "--repeats", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["resident", "fp8-resident", "fp8-streamed"] and all(r["bitwise_equal"] for r in rows.values())


@pytest.mark.parametrize("entry", ["cli", "module"])
def test_ctrl_c_during_a_run_is_one_line_and_exit_130(entry, monkeypatch, capsys) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)

    def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "_run", interrupted)
    try:
        rc = cli_main(["bench", *TINY_WAN]) if entry == "cli" else bench.main(TINY_WAN)
    except KeyboardInterrupt:  # caught here, or it would stop the whole test session
        pytest.fail("Ctrl-C got out of bench.main: the user sees a traceback")
    assert rc == 130
    assert capsys.readouterr().err.splitlines() == ["omni-offload bench: interrupted"]


@pytest.mark.parametrize("flags, says", [
    (["--preset", "tiny-flux", "--frames", "9"],
     "--frames: tiny-flux is an image preset, sized by --px; leave it out, or pick a video preset"),
    (["--preset", "tiny-flux", "--px", "32", "--height", "48", "--width", "64"],
     "--height and --width: tiny-flux is an image preset"),
    (["--preset", "tiny-wan", "--px", "64"],
     "--px: tiny-wan is a video preset, sized by --frames, --height and --width; leave it out"),
    ([*TINY_WAN, "--variants", "peer", "--budget", "50"], "--budget 50: none of --variants peer holds a device budget"),
    # Taken and run as something else: 10 frames ran as 9, one Flux block as two, a chunk size
    # without --transfer-mib was ignored.
    (["--preset", "tiny-wan", "--frames", "5", "10"], "--frames 10: tiny-wan takes 4k+1 frames (the VAE's 4x in "
     "time), so 10 would run as 9; give 9 or 13"),
    (["--preset", "tiny-flux", "--px", "32", "--blocks", "2", "1"], "--blocks 1: tiny-flux builds 2 blocks for it"),
    (["--preset", "tiny-flux", "--chunk-mib", "8"], "--chunk-mib 8: chunk sizes are for --transfer-mib's copy "
     "timing, which this run does not do; add --transfer-mib MIB or leave --chunk-mib out"),
    ([*TINY_WAN, "--variants", "peer", "compiled", "fp8-resident", "--budget", "auto"],
     "none of --variants peer compiled fp8-resident holds a device budget"),
])
def test_flags_the_run_would_not_use_are_refused_before_any_model(flags, says, capsys, no_run) -> None:
    assert bench.main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("omni-offload bench: error: ") and says in err[0]
    assert "args" not in no_run


def test_shape_flags_default_for_the_presets_kind(no_run) -> None:
    assert bench.main(["--preset", "tiny-flux"]) == 0
    assert no_run["args"].px == [1024]
    assert bench.main(["--preset", "tiny-wan", "--frames", "5"]) == 0
    assert (no_run["args"].frames, no_run["args"].height, no_run["args"].width) == ([5], 480, 832)
    assert bench.main([*TINY_WAN, "--variants", "peer", "rank-local", "--budget", "50"]) == 0  # one takes it


@pytest.mark.parametrize("flags, says", [
    (["--frames", "9"], "--frames shapes model cases, which --transfer-mib does not run; leave it out"),
    (["--preset", "tiny-flux", "--px", "64", "--blocks", "3"], "--blocks and --px shape model cases"),
    (["--variants", "rank-local", "--stagger"], "--variants and --stagger shape model cases"),
])
def test_transfer_mib_refuses_the_flags_of_model_cases(flags, says, capsys, no_run, monkeypatch) -> None:
    """They were taken and the transfer run started, timing one block whatever they said."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past --transfer-mib's CUDA check
    monkeypatch.setattr(bench, "maybe_init_dist", lambda *_a, **_k: pytest.fail("the run started"))
    assert bench.main(["--transfer-mib", "700", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert "args" not in no_run


def test_transfer_mib_with_png_is_refused_before_the_run(tmp_path, capsys, no_run, monkeypatch) -> None:
    """The transfer run draws nothing: --png was taken, its folder made, and no chart written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past --transfer-mib's CUDA check
    monkeypatch.setattr(bench, "maybe_init_dist", lambda *_a, **_k: pytest.fail("the run started"))
    png = tmp_path / "charts" / "x.png"
    assert bench.main(["--transfer-mib", "700", "--png", str(png)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--png draws the overhead of model cases; leave out --transfer-mib" in err[0]
    assert "args" not in no_run and not png.parent.exists()


def test_every_timed_forward_is_compared_not_only_the_last() -> None:
    """A variant whose first timed forwards differed (a copy race right after warm-up) was
    reported equal when its last one matched."""
    reference = torch.ones(3)
    outputs = iter([torch.ones(3), torch.zeros(3), torch.ones(3), torch.ones(3)])  # warm-up, 3 timed
    times, equal = bench._timed(lambda: next(outputs), torch.device("cpu"), 1, 3, reference)
    assert len(times) == 3 and equal is False
    # A warm-up forward is judged too: a variant wrong only on its cold first forward (or up to
    # its residency re-plan) is not equal; it is still left out of the times.
    outputs = iter([torch.zeros(3), torch.ones(3), torch.ones(3), torch.ones(3)])
    times, equal = bench._timed(lambda: next(outputs), torch.device("cpu"), 1, 3, reference)
    assert len(times) == 3 and equal is False


def _restored(model) -> bool:
    """Whether ``model``'s blocks are ordinary per-parameter tensors (restored by an undo), not
    bound into a ring's few storages."""
    return len({p.untyped_storage().data_ptr() for n, p in model.named_parameters()
                if "transformer_blocks" in n}) > 10


def test_interleave_undoes_and_releases_one_copy_at_a_time(monkeypatch, capsys) -> None:
    """The undos ran while every copy was still referenced: at the last undo the device held
    one whole model per variant."""
    import gc
    import weakref
    copies, most = [], []
    apply_variant = bench._apply_variant

    def spy(variant, model, device, device_budget=None, restore=True):
        undo, info, handle = apply_variant(variant, model, device, device_budget, restore)
        copies.append(weakref.ref(model))

        def undo_and_count():
            undo()
            gc.collect()
            most.append(sum(_restored(m) for m in (r() for r in copies) if m is not None))

        return undo_and_count, info, handle

    monkeypatch.setattr(bench, "_apply_variant", spy)
    flags = ["--preset", "tiny-flux", "--px", "32", "--warmup", "1", "--repeats", "1", "--interleave",
             "--variants", "rank-local", "--budget", "0", "50"]
    assert bench.main(flags) == 0
    # The copy just undone beside the resident model, never more.
    assert len(most) == 3 and max(most) <= 2


def test_an_interleave_undo_that_fails_still_reports_the_measured_rows(monkeypatch, tmp_path, capsys) -> None:
    apply_variant = bench._apply_variant

    def failing(variant, model, device, device_budget=None, restore=True):
        undo, info, handle = apply_variant(variant, model, device, device_budget, restore)
        if variant == "rank-local":
            def undo():
                raise RuntimeError("undo broke")
        return undo, info, handle

    monkeypatch.setattr(bench, "_apply_variant", failing)
    out_json = tmp_path / "b.json"
    flags = ["--preset", "tiny-flux", "--px", "32", "--warmup", "1", "--repeats", "1", "--interleave",
             "--variants", "rank-local", "--json", str(out_json)]
    bench.main(flags)
    rows = {r["variant"]: r for r in json.loads(out_json.read_text())["results"]}
    assert "undo broke" in rows["rank-local"]["note"] and len(rows["rank-local"]["timings_ms"]) == 1
    assert "undo broke" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [[], ["--interleave"]], ids=["passes", "interleave"])
def test_a_variant_wrong_only_on_its_untimed_forwards_is_not_equal(extra, monkeypatch, capsys) -> None:
    # rank-local's first forward after it is applied (a warm-up) is off by 1e-3.
    monkeypatch.setattr(bench, "_apply_ours", nudged_outputs(bench._apply_ours, forwards=1))
    flags = ["--preset", "tiny-flux", "--px", "32", "--warmup", "1", "--repeats", "1",
             "--variants", "rank-local", *extra]
    assert bench.main(flags) != 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if " rank-local " in line]
    assert rows and all(row[-1] == "NO" for row in rows)


def test_a_budget_row_whose_passes_planned_differently_records_both_plans() -> None:
    """The row pooled two passes that ran different plans but reported pass 1's plan, with
    pass 1's predicted ratio beside a predicted_ms from both passes."""
    opts = bench.BenchOptions(device=torch.device("cpu"), dtype=torch.float32)
    plan = dict(device_budget=1000, resident_blocks=0, kept_blocks=9, streamed_bytes=100)
    passes = {"resident": [bench._Pass([1.0, 1.0], True, 0.0)] * 2,
              "rank-local@85%": [bench._Pass([3.0, 3.0], True, 0.0, slots=2, predicted_ms=100.0,
                                              predicted_ratio=1.0, **plan),
                                 bench._Pass([1.0, 1.0], True, 0.0, slots=3, predicted_ms=20.0,
                                              predicted_ratio=2.0, **plan)]}
    rows = {r.variant: r for r in bench._summarise(passes, "tiny-flux", 9, "64", [0.0] * 9, [1] * 9, opts, 1000)}
    row = rows["rank-local@85%"]
    assert row.plans_differ is True and [p["slots"] for p in row.plans] == [2, 3]
    assert row.predicted_ms == 60.0 and row.predicted_ratio == 1.5
    assert "passes ran different residency plans" in bench.format_table(list(rows.values()))
    assert rows["resident"].plans is None and rows["resident"].plans_differ is False
    same = {**passes, "rank-local@85%": [passes["rank-local@85%"][0]] * 2}
    row = {r.variant: r for r in bench._summarise(same, "tiny-flux", 9, "64", [0.0] * 9, [1] * 9, opts, 1000)}
    assert row["rank-local@85%"].plans_differ is False and len(row["rank-local@85%"].plans) == 2


def test_a_variant_that_fell_back_says_so_in_its_row_and_the_table() -> None:
    opts = bench.BenchOptions(device=torch.device("cpu"), dtype=torch.float32)
    passes = {"resident": [bench._Pass([1.0], True, 0.0)],
              "allgather": [bench._Pass([1.0], True, 0.0, transfer="rank-local", fell_back=True)],
              "rank-local": [bench._Pass([1.0], True, 0.0, transfer="rank-local")]}
    rows = {r.variant: r for r in bench._summarise(passes, "tiny-flux", 5, "32", [0.0] * 5, [1] * 5, opts, 5)}
    assert rows["allgather"].fell_back is True and rows["allgather"].weight_transfer == "rank-local"
    assert rows["rank-local"].fell_back is False
    assert "allgather (fell back to rank-local)" in bench.format_table(list(rows.values()))
    # What sets the flag: the ring's fallback reason, read where the variant is applied.
    model = build_model(PRESETS["tiny-flux"], 2, torch.device("cpu"), torch.float32)
    undo, info, _ = bench._apply_variant("rank-local", model, torch.device("cpu"))
    undo()
    assert info["fell_back"] is False


def test_the_budget_sweep_draws_no_predicted_point_where_the_planner_predicted_nothing(monkeypatch, tmp_path) -> None:
    """A row with every block resident and no predicted_ms was drawn at a made-up 1.0."""
    from omni_dist_offload.tools import timeline

    figures = []
    make = timeline._figure
    monkeypatch.setattr(timeline, "_figure", lambda *a, **k: figures.append(make(*a, **k)) or figures[-1])
    block = 100 * 2**20

    def row(variant, share, overhead, predicted_ms=None, resident_blocks=0):
        return CaseResult(preset="flux-12b", blocks=4, shape="1024", variant=variant, forward_ms=10.0 * overhead,
                          overhead=overhead, floor_ms=10.0, peak_device_mib=0, host_mib=0, setup_s=0,
                          bitwise_equal=True, device_budget=int(share * block) if share else None,
                          block_mib=block / 2**20, predicted_ms=predicted_ms, resident_blocks=resident_blocks)

    rows = [row("resident", None, 1.0), row("rank-local@50%", 0.5, 1.5, predicted_ms=14.0),
            row("rank-local@100%", 1.0, 0.9, resident_blocks=4)]
    timeline.draw_budget_sweep(rows, tmp_path / "sweep.png")
    (ax,) = figures[0].axes
    (pred,) = [line for line in ax.get_lines() if line.get_label().endswith(": predicted")]
    assert list(pred.get_xdata()) == [50.0] and list(pred.get_ydata()) == [1.4]


def test_floor_ms_is_recomputed_from_the_figures_in_the_file(tmp_path, monkeypatch) -> None:
    # A slow link stands in for the GPU's, so that the floor is more than the resident forward:
    # the per-block compute and bytes it is made of are in the file, as meta["figures"] says.
    monkeypatch.setattr(bench, "h2d_bandwidth", lambda device, nbytes=0: 1e5)
    out_json = tmp_path / "bench.json"
    assert bench.main([*TINY_WAN, "--variants", "rank-local", "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in data["results"]}
    bandwidth = data["meta"]["h2d_bytes_per_s"]
    assert bandwidth == 1e5 and "block_compute_ms" in data["meta"]["figures"]["floor_ms"]
    row, resident = rows["rank-local"], rows["resident"]
    assert len(row["block_compute_ms"]) == len(row["block_bytes"]) == row["blocks"] > 0
    link = [b / bandwidth * 1e3 for b in row["block_bytes"]]
    want = resident["forward_ms"] + sum(max(c, l) - c for c, l in zip(row["block_compute_ms"], link))
    assert row["floor_ms"] == pytest.approx(want) and row["floor_ms"] > resident["forward_ms"]
    assert resident["floor_ms"] == resident["forward_ms"]
