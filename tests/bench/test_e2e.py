"""`ktrans bench e2e` on the embedded tiny model under the CPU rules: one JSON object with every field, numbers
that add up, and the CPU pool's busy counter that the split reads."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ktrans.config import RULES_DIR

FIELDS = {"model", "gguf_path", "rules", "options", "layers", "threads", "machine", "load_s", "prefill_tok_s",
          "decode_tok_s", "ttft_ms", "tpot_ms", "split_ms", "batches", "host_rss_gib", "host_peak_rss_gib",
          "host_hugepages_gib", "gpu_memory", "profiled_batch"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def report(run_dir):
    out = subprocess.run([sys.executable, "-m", "ktrans.cli", "bench", "e2e", "--optimize_config_path",
                          str(RULES_DIR / "Qwen3Next-cpu.yaml"), "--prompt_len", "40", "--gen_len", "6",
                          "--batch_sizes", "1,3", "--chunk_size", "32", "--json", "--routing_stats_out",
                          str(run_dir / "routing.json")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "routing statistics of" in out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_routing_statistics_of_the_measured_runs(report, run_dir):
    """--routing_stats_out: every MoE layer's counts over the measured runs (after the warm-up): batch 1 and 3 of
    40-token prompts, each fed 40 + 5 tokens, k experts each."""
    stats = json.loads((run_dir / "routing.json").read_text())
    k, fed = 4, (1 + 3) * (40 + 5)  # the embedded tiny model routes to 4 of 16 experts
    assert stats["num_experts"] == 16 and len(stats["layers"]) == report["layers"]
    assert all(sum(c) == fed * k for c in stats["layers"].values()), {n: sum(c) for n, c in stats["layers"].items()}


def test_every_field(report):
    assert FIELDS <= set(report)
    assert report["layers"] == 4 and report["rules"].endswith("Qwen3Next-cpu.yaml")
    assert set(report["decode_tok_s"]) == set(report["ttft_ms"]) == set(report["tpot_ms"]) == {"1", "3"}
    assert report["prefill_tok_s"] > 0 and all(v > 0 for v in report["decode_tok_s"].values())
    assert report["load_s"] > 0 and report["host_rss_gib"] > 0.05 and report["host_peak_rss_gib"] >= report[
        "host_rss_gib"] * 0.99
    huge = report["host_hugepages_gib"]  # where /proc has smaps_rollup: the THP part of the process's memory
    assert huge is None or 0 <= huge <= report["host_peak_rss_gib"]
    assert report["gpu_memory"] == {} and report["machine"]["gpus"] == []
    assert report["profiled_batch"] is None  # not asked for (and no GPU to profile)
    assert report["machine"]["threads_per_core"] in (None, 1, 2, 4, 8) and report["machine"]["pool_pinned"] in (True, False)


def test_steps_add_up(report):
    b1, b3 = report["batches"]
    # 40 prompt tokens in chunks of 32: 2 prefill steps; the 2nd makes the first token; 5 decode steps follow
    assert (b1["steps"], b1["decode_steps"]) == (2 + 5, 5)
    assert b1["graph_captures"] is None and b3["graph_captures"] is None  # no CUDA graphs on the CPU
    assert 1 <= b3["decode_steps"] <= 5 and b3["steps"] > b1["steps"]
    assert b1["ttft_ms"] > 0 and b1["tpot_ms"] > 0
    sp = report["split_ms"]
    assert sp["gpu_measured"] is False and sp["gpu"] == 0.0
    assert 0 < sp["cpu_experts"] < sp["wall"]  # the experts ran on the pool, inside the step
    assert sp["host"] == pytest.approx(sp["wall"] - sp["cpu_experts"])
    assert b1["step_ms"]["wall"] == pytest.approx(sp["wall"])
    assert 0 < b1["step_ms_median"] <= max(b1["step_ms"]["wall"] * b1["decode_steps"], 1e-9)
    # decode tok/s is the decode steps' tokens over their time
    assert report["decode_tok_s"]["3"] == pytest.approx(3e3 / b3["step_ms"]["wall"], rel=1e-6)


def test_pool_busy_counts_jobs():
    from ktrans.kernels.cpu import CPUMoE, make_pool
    from ktrans.weights.quants import quantize

    pool = make_pool(2, pin=False)
    e, h, i = 4, 256, 256
    g = torch.Generator().manual_seed(0)
    mats = [torch.from_numpy(quantize((torch.randn(e * r, c, generator=g) * 0.05).numpy(), "Q8_0")).reshape(e, r, -1)
            for r, c in ((i, h), (i, h), (h, i))]
    moe = CPUMoE(*mats, n_experts=e, hidden=h, intermediate=i, types=("Q8_0",) * 3, pool=pool)
    jobs0, busy0 = pool.busy()
    assert (jobs0, busy0) == (0, 0)
    x = torch.randn(8, h)
    ids = torch.randint(0, e, (8, 2), dtype=torch.int64)
    for _ in range(3):
        moe.forward(x, ids, torch.full((8, 2), 0.5))
    jobs, busy = pool.busy()
    assert jobs >= 3 and busy > 0


def test_itl_while_a_long_prompt_prefills():
    """--itl_prefill_len: two requests decode, a 300-token prompt arrives and is prefilled in 64-token steps beside
    them (62 of its tokens a step: 5 steps); their ITLs sample 16 decode-only steps and those 5."""
    out = subprocess.run([sys.executable, "-m", "ktrans.cli", "bench", "e2e", "--optimize_config_path",
                          str(RULES_DIR / "Qwen3Next-cpu.yaml"), "--prompt_len", "8", "--gen_len", "4",
                          "--batch_sizes", "1", "--chunk_size", "64", "--profile_steps", "0",
                          "--itl_prefill_len", "300", "--itl_decodes", "2", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    itl = json.loads(out.stdout.strip().splitlines()[-1])["itl_during_prefill"]
    assert (itl["decodes"], itl["prompt_len"], itl["chunk_steps"], itl["itl_count"]) == (2, 300, 5, 2 * (16 + 5))
    assert 0 < itl["itl_p50_ms"] <= itl["itl_p99_ms"] <= itl["itl_max_ms"] and itl["chunk_ms"] <= itl["chunk_ms_max"]
    assert itl["ttft_ms"] > 0 and isinstance(itl["holds"], bool)
    assert itl["chunk_tokens"] == [64, 64, 64, 64, 300 - 4 * 62 + 2]  # each step's decode rows plus its chunk


def test_itl_flags_are_checked():
    from ktrans.bench.e2e import E2EOptions

    with pytest.raises(ValueError, match="--itl_decodes"):
        E2EOptions(itl_prefill_len=100, itl_decodes=0)
    with pytest.raises(ValueError, match="--prefix_cache_max_snapshots"):
        E2EOptions(prefix_cache_max_snapshots=0)


def test_no_warmup_reaches_the_run(report):
    """`--no-warmup` skips the engine's warm-up (warmup_s 0; the default run above warms up)."""
    out = subprocess.run([sys.executable, "-m", "ktrans.cli", "bench", "e2e", "--optimize_config_path",
                          str(RULES_DIR / "Qwen3Next-cpu.yaml"), "--prompt_len", "8", "--gen_len", "2",
                          "--batch_sizes", "1", "--profile_steps", "0", "--no-warmup", "--max_batch_size", "3",
                          "--cache_lens", "300", "--prefix_cache_max_snapshots", "2", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["warmup_s"] == 0.0 and report["warmup_s"] > 0
    # the engine as asked (the memory figures depend on it); the default run's is sized by its runs, 32 snapshots
    assert got["engine"] == {"max_batch_size": 3, "cache_lens": 300, "prefix_cache_max_snapshots": 2}
    assert report["engine"]["max_batch_size"] == 3 and report["engine"]["prefix_cache_max_snapshots"] == 32


def test_top_kernels_rank_device_time_per_step():
    from types import SimpleNamespace as NS

    from ktrans.bench.measure import top_kernels

    ev = lambda name, a, b: NS(name=name, time_range=NS(start=a, end=b))  # noqa: E731
    events = [ev("gemv_kernel", 0, 10), ev("gemv_kernel", 20, 26), ev("_moe_lanes_kernel", 30, 60),
              ev("x" * 100, 60, 61), ev("gemv_kernel", 70, 74)]
    got = top_kernels(events, steps=2, n=2)
    assert got == {"_moe_lanes_kernel": (15.0, 0.5), "gemv_kernel": (10.0, 1.5)}
    assert list(top_kernels(events, steps=1))[-1] == "x" * 80


def test_busy_union_counts_waiting_and_early_started_kernels_out():
    """bench e2e's GPU share: overlapping kernels counted once, the CPU experts' poll not at all, and a kernel that
    started while the poll ran (programmatic dependent launch) only from the poll's end."""
    from ktrans.bench.measure import busy_union

    assert busy_union([(0, 10, False), (5, 12, False), (20, 25, False)]) == 17
    # a poll 10..100, the kernel after it launched at 11 (waiting at its top until 100), busy 100..104
    assert busy_union([(0, 10, False), (10, 100, True), (11, 104, False), (104, 106, False)]) == 10 + 4 + 2
    assert busy_union([(3, 3, False), (5, 4, False)]) == 0


def test_own_time_leaves_a_kernels_wait_for_its_predecessor_out():
    """gpu_kernels_own_us: a kernel launched early under programmatic dependent launch (its span starting inside its
    predecessor's) counts only from the predecessor's end, so the per-kernel times add up to the busy union (with
    the poll counted); spans given out of order are attributed to their own events."""
    from types import SimpleNamespace as NS

    from ktrans.bench.measure import busy_union, own_times, top_kernels

    # gemv 0..10, stage_in launched at 4 (waits to 10) ending 13, the poll 13..100, stage_out launched at 14 ending 103
    spans = [(0, 10), (4, 13), (13, 100), (14, 103), (103, 103)]
    assert own_times(spans) == [10, 3, 87, 3, 0]
    assert own_times(spans[::-1]) == [0, 3, 87, 3, 10]
    assert sum(own_times(spans)) == busy_union([(a, b, False) for a, b in spans])
    ev = lambda name, a, b: NS(name=name, time_range=NS(start=a, end=b))  # noqa: E731
    names = ["gemv_kernel", "_stage_in_kernel", "_cpu_wait_kernel", "_stage_out_kernel", "empty"]
    events = [ev(n, a, b) for n, (a, b) in zip(names, spans)]
    assert top_kernels(events, steps=1)["_stage_out_kernel"] == (89.0, 1.0)  # its span, the wait in it
    own = top_kernels(events, steps=1, own=True)
    assert own["_stage_out_kernel"] == (3.0, 1.0) and own["_stage_in_kernel"] == (3.0, 1.0)
    assert list(own)[0] == "_cpu_wait_kernel"


def test_profile_batch_flag_is_checked():
    from ktrans.bench.e2e import E2EOptions

    with pytest.raises(ValueError, match="--profile_batch"):
        E2EOptions(profile_batch=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profiled_batch_step_on_the_gpu():
    """--profile_batch 3 on the GPU rules: three requests' decode steps profiled after their prefills; the step's
    GPU busy time is inside its wall time, its kernels are named, and the engine was sized for the three."""
    out = subprocess.run([sys.executable, "-m", "ktrans.cli", "bench", "e2e", "--optimize_config_path",
                          str(RULES_DIR / "Qwen3Next-gpu.yaml"), "--prompt_len", "24", "--gen_len", "4",
                          "--batch_sizes", "1", "--profile_steps", "3", "--profile_batch", "3", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    pb = got["profiled_batch"]
    assert pb["batch_size"] == 3 and got["engine"]["max_batch_size"] >= 3
    assert 0 < pb["gpu_ms"] <= pb["wall_ms"] * 1.05 and pb["device_ops"] > 0
    assert pb["gpu_kernels_own_us"] and all(us >= 0 and n > 0 for us, n in pb["gpu_kernels_own_us"].values())
    assert got["split_ms"]["gpu_measured"] is True  # the batch-1 profile is still there
    # the measured run's graph buckets were captured by the run of its shape beforehand
    assert got["cuda_graphs"]["captured"] >= 1 and got["batches"][0]["graph_captures"] == 0


@pytest.fixture(scope="module")
def quantized_gpu_run(tmp_path_factory):
    """A tiny Q4_K_M GGUF whose widths fill whole super-blocks (so its matrices are Q4_K and Q6_K as in the 80B
    file), written by `make-tiny` with its tokenizer, and the GPU rules with the Triton layer ops; returns a function
    running `bench e2e` on them under environment flags."""
    import os
    import signal
    import time
    from pathlib import Path

    from ktrans.model.tiny import preset_config

    d = tmp_path_factory.mktemp("q4km")
    config = {**preset_config("tiny"),
              "hidden_size": 256, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
              "num_experts": 8}
    (d / "config.json").write_text(json.dumps(config))
    gguf = d / "t.gguf"
    subprocess.run([sys.executable, "-m", "ktrans.cli", "make-tiny", "--preset", str(d / "config.json"), "--gguf",
                    "--quant", "q4_k_m", "--out", str(gguf)], check=True, capture_output=True, timeout=300)
    rules = d / "gpu-triton.yaml"
    subprocess.run([sys.executable, str(Path(__file__).parents[2] / "scripts" / "rules_with_ops.py"),
                    str(RULES_DIR / "Qwen3Next-gpu.yaml"), str(rules), "triton"], check=True, capture_output=True,
                   timeout=60)

    # KTRANS_TEST_E2E_TIMEOUT: a shorter cap where a device call runs the cases side by side
    cap = float(os.environ.get("KTRANS_TEST_E2E_TIMEOUT", "300"))

    def run(env: dict) -> dict:
        proc = subprocess.Popen([sys.executable, "-m", "ktrans.cli", "bench", "e2e", "--gguf_path", str(gguf),
                                 "--optimize_config_path", str(rules), "--prompt_len", "24", "--gen_len", "8",
                                 "--batch_sizes", "1,4", "--use_cuda_graph", "--profile_steps", "2",
                                 "--profile_batch", "4", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, **env})
        try:
            stdout, stderr = proc.communicate(timeout=cap)
        except subprocess.TimeoutExpired:
            # where it waits, before it goes: the state (D: in the kernel, e.g. a driver wait on a GPU that does not
            # finish) and wait channel of each thread, then every thread's Python stack (SIGUSR1)
            tasks = Path(f"/proc/{proc.pid}/task")
            waits = sorted(f"{(t / 'stat').read_text().split(')')[-1].split()[0]} {(t / 'wchan').read_text()}"
                           for t in tasks.iterdir()) if tasks.is_dir() else []
            proc.send_signal(signal.SIGUSR1)
            time.sleep(5)
            proc.kill()
            try:
                _, stderr = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:  # still not gone: in the kernel
                stderr = "(the process did not end within 15 s of SIGKILL)"
            pytest.fail(f"bench e2e under {env} did not end in {cap:g} s; threads (state, wait): {waits}; "
                        f"stderr: {stderr[-3000:]}")
        assert proc.returncode == 0, (env, stderr[-2000:])
        return json.loads(stdout.strip().splitlines()[-1])

    return run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("flags, kernel, absent", [
    ({}, None, None),
    ({"KTRANS_GEMV_ROWS_REG": "1"}, "rows_reg_kernel", None),
    ({"KTRANS_GEMV_TILE_FUSED_SUM": "1"}, None, None),
    ({"KTRANS_GEMV_PAIR": "1"}, None, None),
    ({"KTRANS_MOE_FUSED_SHARED": "1"}, None, None),
    ({"KTRANS_ROUTER_FUSED": "1"}, "_dense_route_kernel", None),
    ({"KTRANS_ROUTER_FUSED": "1", "KTRANS_MOE_FUSED_SHARED": "1"}, "_dense_route_kernel", None),
    ({"KTRANS_GDN_DECODE_NORM": "1"}, None, "_rms_norm_gated_kernel"),
    ({"KTRANS_GDN_DECODE_FOLD": "1"}, "_fold_kernel", "_state_kernel"),
    ({"KTRANS_ATTN_SHORT_SPLITS": "1"}, None, None),
    ({"KTRANS_GEMV_ROWS_REG": "1", "KTRANS_GEMV_PAIR": "1", "KTRANS_MOE_FUSED_SHARED": "1"}, "rows_reg_kernel", None),
    ({"KTRANS_GEMV_PAIR": "1", "KTRANS_MOE_FUSED_SHARED": "1", "KTRANS_ROUTER_FUSED": "1",
      "KTRANS_GDN_DECODE_NORM": "1", "KTRANS_GDN_DECODE_FOLD": "1", "KTRANS_ATTN_SHORT_SPLITS": "1"},
     "_dense_route_kernel",
     ("_rms_norm_gated_kernel", "_state_kernel")),
], ids=["defaults", "rows", "tile-fused-sum", "pair", "fused-shared", "router", "router+fused-shared", "gdn-norm",
        "gdn-fold", "attn-short-splits", "rows+pair+fused-shared", "batch-1-levers"])
def test_opt_in_decode_kernels_under_cuda_graphs(quantized_gpu_run, flags, kernel, absent):
    """Each opt-in decode kernel flag (and the three together, which did not end their warm-up at full size on the
    H200 in session 36; and the batch-1 levers together) on a Q4_K_M file with CUDA graphs: the run ends, decodes at
    batch 1 and 4 from graphs captured beforehand, and the 4-request step's profile names the flag's kernel where it
    has one of its own, and not the launch it folds in."""
    got = quantized_gpu_run(flags)
    assert set(got["decode_tok_s"]) == {"1", "4"} and all(v > 0 for v in got["decode_tok_s"].values())
    assert got["cuda_graphs"]["captured"] >= 2 and all(b["graph_captures"] == 0 for b in got["batches"])
    names = " ".join(got["profiled_batch"]["gpu_kernels_own_us"])
    assert kernel is None or kernel in names, names
    absent = (absent,) if isinstance(absent, str) else absent or ()
    assert not [a for a in absent if a in names], names
