"""`ktrans rules show` / `validate`: placement and memory of the real 80B config from each shipped file, no GPU."""
from __future__ import annotations

import json

import pytest
import torch

from ktrans.cli import main
from ktrans.config import CONFIGS_DIR, RULES_DIR, ModelConfig
from ktrans.inject.report import compress, placement_report

from .helpers import SHIPPED, rules

CFG80B = ModelConfig.from_json(CONFIGS_DIR / "qwen3-next-80b-a3b.json")
EXPERT_BYTES = 48 * 512 * 3 * 2048 * 512 * 2  # bf16
KV_PER_TOKEN = 12 * 2 * 2 * 256 * 2           # 12 attention layers, K and V, 2 kv heads, head_dim 256, bf16
STATE_PER_SLOT = 36 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)  # conv (bf16) + fp32 recurrent
# What an engine allocates for --cache_lens 1000 --max_batch_size 3 at serve's defaults (--page_size 16, 32 prefix-cache
# snapshots): 63 pages and the pad page; 3 running slots, 32 snapshot slots and the pad slot (runtime.pools)
KV_ROWS_1000, SLOTS_3 = 64 * 16, 3 + 32 + 1


def show(capsys, name: str, *extra: str) -> dict:
    assert main(["rules", "show", "--optimize_config_path", str(RULES_DIR / name), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def rows(report: dict) -> dict[str, dict]:
    return {r["module"]: r for r in report["modules"]}


@pytest.mark.parametrize("name", SHIPPED)
def test_show_runs_on_every_shipped_file_for_80b(capsys, name):
    rep = show(capsys, name, "--cache_lens", "1000", "--max_batch_size", "3")
    assert rep["config"].endswith("qwen3-next-80b-a3b.json") and not rep["warnings"]
    r = rows(rep)
    experts = r["model.layers.{0..47}.mlp.experts"]
    assert experts["count"] == 48 and experts["rule"] == 5 and experts["bytes"] == EXPERT_BYTES
    assert r["model.layers.{3,7,..,47}.self_attn"]["count"] == 12
    assert r["model.layers.{0..2,4..6,..,44..46}.linear_attn"]["count"] == 36
    assert r["model.layers.{0..47}.mlp.shared_expert_gate"]["rule"] is None  # the negative look-ahead
    mem = rep["memory"]
    gpu = "cpu" if name == "Qwen3Next-cpu.yaml" else "cuda:0"
    assert mem[gpu]["kv"] == KV_ROWS_1000 * KV_PER_TOKEN and mem[gpu]["state"] == SLOTS_3 * STATE_PER_SLOT
    assert (rep["kv_tokens"], rep["state_slots"], rep["page_size"], rep["snapshot_slots"]) == (KV_ROWS_1000, 36, 16, 32)
    total = sum(m["weights"] for m in mem.values())
    assert 145e9 < total < 165e9  # ~80B parameters at 2 bytes


@pytest.mark.parametrize("name", ["Qwen3Next-serve-2gpu.yaml", "Qwen3Next-2gpu.yaml"])
def test_two_gpu_files_split_the_80b_evenly(capsys, name):
    """The 2-GPU files on the real config: each GPU holds half of the 12 attention layers' KV and of the 36 DeltaNet
    layers' state; their weights differ only by the final norm (cuda:1 has lm_head, cuda:0 the same-sized
    embedding)."""
    rep = show(capsys, name, "--cache_lens", "1000", "--max_batch_size", "3", "--weight_dtype", "bf16")
    assert not rep["warnings"]
    mem, r = rep["memory"], rows(rep)
    for gpu in ("cuda:0", "cuda:1"):
        assert mem[gpu]["kv"] == KV_ROWS_1000 * KV_PER_TOKEN // 2 and mem[gpu]["state"] == SLOTS_3 * STATE_PER_SLOT // 2
    assert mem["cuda:1"]["weights"] - mem["cuda:0"]["weights"] == 2048 * 4
    assert r["model.layers.{0..23}"]["generate"] == "cuda:0" and r["model.layers.{24..47}"]["generate"] == "cuda:1"
    assert r["model.layers.{24..47}"]["out_device"] == "cuda:1" and r["lm_head"]["generate"].startswith("cuda:1")
    experts = [r[f"model.layers.{{{k}}}.mlp.experts"] for k in ("0..23", "24..47")]
    assert [e["generate"].split()[0] for e in experts] == (["cpu"] * 2 if "serve" in name else ["cuda:0", "cuda:1"])
    assert sum(e["bytes"] for e in experts) == EXPERT_BYTES
    total = sum(m["weights"] for m in mem.values())
    assert 145e9 < total < 165e9


def test_serve_placement_of_80b(capsys):
    rep = show(capsys, "Qwen3Next-serve.yaml")
    experts = rows(rep)["model.layers.{0..47}.mlp.experts"]
    assert experts["prefill"] == "cuda:0 KExpertsSplit (streamed)"
    staged = [n for n in rep["notes"] if n.startswith("KExpertsSplit")]
    assert len(staged) == 1 and "on cuda:0" in staged[0]
    assert experts["generate"].startswith("cpu KExpertsCPU") and experts["out_device"] == "cuda:0"
    assert rows(rep)["model.embed_tokens"]["class"] == "KEmbedding"
    mem = rep["memory"]
    assert mem["cpu"]["weights"] == EXPERT_BYTES  # the experts live in CPU RAM, the embedding table on the GPU
    assert mem["cuda:0"]["weights"] < 5 * 2**30
    assert mem["cpu"]["kv"] == 0
    assert mem["cuda:0"]["kv"] == (32768 + 16) * KV_PER_TOKEN  # the default --cache_lens, and the pad page


def test_quantized_weight_bytes(capsys):
    rep = show(capsys, "Qwen3Next-serve.yaml", "--weight_dtype", "q4_k")
    assert rows(rep)["model.layers.{0..47}.mlp.experts"]["bytes"] == EXPERT_BYTES // 2 * 144 // 256  # 144-byte blocks of 256
    assert main(["rules", "show", "--optimize_config_path", str(RULES_DIR / "Qwen3Next-cpu.yaml"),
                 "--weight_dtype", "q3"]) == 2
    assert "unknown weight dtype 'q3'" in capsys.readouterr().err


def test_text_report_and_unused_rule_warning(capsys, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text((RULES_DIR / "Qwen3Next-cpu.yaml").read_text() + "\n- match: {name: '^model\\.vision'}\n")
    assert main(["rules", "show", "--optimize_config_path", str(path), "--config", "qwen3-next-80b-a3b"]) == 0
    out = capsys.readouterr()
    assert "model.layers.{0..47}.mlp.experts" in out.out and "KExpertsCPU" in out.out
    assert "warning: rule 11 (line" in out.err and "matches no module" in out.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_check_devices_refuses_cuda_rules_here(capsys):
    args = ["rules", "show", "--optimize_config_path", str(RULES_DIR / "Qwen3Next-serve.yaml"), "--check_devices"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "CUDA is missing" in err and "Qwen3Next-cpu.yaml" in err
    assert main(["rules", "validate", str(RULES_DIR / "Qwen3Next-gpu.yaml"), "--check_devices"]) == 2


def test_validate_command(capsys, tmp_path):
    assert main(["rules", "validate", *(str(RULES_DIR / n) for n in SHIPPED)]) == 0
    assert capsys.readouterr().out.count("ok: ") == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("- match: {name: '(('}\n")
    assert main(["rules", "validate", str(bad)]) == 2
    assert "bad.yaml: rule 1 (line 1): match.name: bad regex" in capsys.readouterr().err


def test_show_for_a_checkpoint_directory(capsys, tmp_path):
    from ..model.helpers import make_checkpoint

    ckpt = make_checkpoint(tmp_path, "small")
    rep = show(capsys, "Qwen3Next-cpu.yaml", "--model_path", str(ckpt), "--weight_dtype", "f32")
    r = rows(rep)
    assert r["model.layers.{0..7}.mlp.experts"]["bytes"] == 8 * 32 * 3 * 128 * 48 * 4
    assert main(["rules", "show", "--optimize_config_path", str(RULES_DIR / "Qwen3Next-cpu.yaml"),
                 "--model_path", str(ckpt), "--config", "x.json"]) == 2
    assert "give at most one of" in capsys.readouterr().err


def test_report_api_and_default_device():
    from ktrans.model.tiny import preset_config

    cfg = ModelConfig.from_hf_dict(preset_config("small"))
    rs = rules("- match: {class: Qwen3NextAttention}\n  replace: {class: KQwen3NextAttention, kwargs: {generate_device: cuda}}")
    rep = placement_report(cfg, rs, cache_lens=10, default_device="cpu")
    assert rep.default_device == "cpu" and list(rep.memory) == ["cpu", "cuda:0"]
    per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    assert rep.memory["cuda:0"]["kv"] == 2 * 16 * per_layer * len(cfg.full_attention_layers)  # a page and the pad page
    # No rule for the projections: they follow the attention operator that contains them; the rest stays on cpu.
    assert {r.name: r.prefill for r in rep.rows}["model.layers.{3,7}.self_attn.q_proj"] == "cuda:0"
    assert {r.name: r.prefill for r in rep.rows}["model.layers.{0..7}.mlp.gate"] == "cpu"
    assert rep.memory["cuda:0"]["weights"] > 0


def test_compress():
    assert compress(list(range(48))) == "0..47"
    assert compress(list(range(3, 48, 4))) == "3,7,..,47"
    assert compress([i for i in range(48) if i % 4 != 3]) == "0..2,4..6,..,44..46"
    assert compress([1, 2, 5]) == "1..2,5" and compress([4]) == "4"


def _tiny_q4_k_m(capsys, tmp_path):
    """(path, GGUFFile, stored bytes per tensor, the experts' stored bytes) of the tiny model as a Q4_K_M file."""
    from ktrans.weights.gguf_source import GGUFSource

    out = tmp_path / "tiny.gguf"
    assert main(["make-tiny", "--gguf", "--out", str(out), "--quant", "q4_k_m"]) == 0
    capsys.readouterr()
    file = GGUFSource(out).file
    stored = {n: i.nbytes for n, i in file.tensors.items()}
    return out, file, stored, sum(b for n, b in stored.items() if "_exps." in n)


def test_show_takes_the_tensor_types_of_a_gguf_file(capsys, tmp_path):
    """A Q4_K_M file mixes types (here, at the tiny model's widths, Q5_0 and Q8_0 experts beside F32 norms): each
    tensor counts at its stored type, not at bf16."""
    out, file, stored, experts = _tiny_q4_k_m(capsys, tmp_path)
    assert len({file.info(n).type_name for n in stored if "_exps." in n}) >= 2  # a real mix
    rep = show(capsys, "Qwen3Next-cpu.yaml", "--gguf_path", str(out))
    assert rep["weight_dtype"] == "gguf"
    n_layers = file.metadata["qwen3next.block_count"]
    assert rows(rep)[f"model.layers.{{0..{n_layers - 1}}}.mlp.experts"]["bytes"] == experts
    total = sum(m["weights"] for m in rep["memory"].values())
    assert abs(total - sum(stored.values())) < 0.02 * sum(stored.values())  # every tensor, at its own type
    bf16 = show(capsys, "Qwen3Next-cpu.yaml", "--gguf_path", str(out), "--weight_dtype", "bf16")
    assert rows(bf16)[f"model.layers.{{0..{n_layers - 1}}}.mlp.experts"]["bytes"] > 2 * experts  # the flag wins
    assert main(["rules", "show", "--optimize_config_path", str(RULES_DIR / "Qwen3Next-cpu.yaml"),
                 "--gguf_path", str(out)]) == 0
    assert f"weights: as stored in {out}" in capsys.readouterr().out


def test_show_gpu_rules_count_the_quantized_ops_at_the_file_types(capsys, tmp_path):
    """Qwen3Next-gpu.yaml keeps the GGUF's blocks on the GPU (KLinearMarlin, KExpertsMarlin): its GPU memory is the
    file's tensors at their stored types; the same rules with the reference ops count what those hold, bf16."""
    out, file, stored, experts = _tiny_q4_k_m(capsys, tmp_path)
    n_layers = file.metadata["qwen3next.block_count"]
    key = f"model.layers.{{0..{n_layers - 1}}}.mlp.experts"
    rep = show(capsys, "Qwen3Next-gpu.yaml", "--gguf_path", str(out))
    assert rows(rep)[key]["bytes"] == experts
    gpu = rep["memory"]["cuda:0"]["weights"]
    assert abs(gpu - sum(stored.values())) < 0.02 * sum(stored.values())
    torch_rules = tmp_path / "torch.yaml"
    torch_rules.write_text((RULES_DIR / "Qwen3Next-gpu.yaml").read_text()
                           .replace('"KLinearMarlin"', '"KLinearTorch"').replace('"KExpertsMarlin"', '"KExpertsTorch"'))
    ref = show(capsys, str(torch_rules), "--gguf_path", str(out))
    assert rows(ref)[key]["bytes"] > 2 * experts  # dequantized to bf16 at load


def test_memory_follows_the_serve_flags(capsys):
    """--page_size and the prefix cache's snapshot slots change the KV and state figures as they change what an
    engine allocates; bad values name the flag."""
    rep = show(capsys, "Qwen3Next-cpu.yaml", "--cache_lens", "1000", "--max_batch_size", "3", "--page_size", "64",
               "--no-enable_prefix_cache")
    assert (rep["kv_tokens"], rep["state_slots"]) == (16 * 64 + 64, 3 + 1)
    assert rep["memory"]["cpu"]["kv"] == 17 * 64 * KV_PER_TOKEN and rep["memory"]["cpu"]["state"] == 4 * STATE_PER_SLOT
    rep = show(capsys, "Qwen3Next-cpu.yaml", "--max_batch_size", "3", "--prefix_cache_max_snapshots", "5")
    assert rep["state_slots"] == 3 + 5 + 1
    assert main(["rules", "show", "--optimize_config_path", str(RULES_DIR / "Qwen3Next-cpu.yaml"),
                 "--page_size", "0"]) == 2
    assert "--page_size" in capsys.readouterr().err


def test_gpu_experts_counted_on_the_gpu(tmp_path):
    """The serve rules with `gpu_experts: 64`: the experts stay in CPU RAM whole, and 64 of each layer's 512 come on
    top of the GPU's weights."""
    from ktrans.inject import parse_rules

    text = (RULES_DIR / "Qwen3Next-serve.yaml").read_text()
    hybrid = text.replace('      generate_op: "KExpertsCPU"', '      generate_op: "KExpertsCPU"\n      gpu_experts: 64')
    assert hybrid != text
    base = placement_report(CFG80B, parse_rules(text, "serve.yaml")).memory
    mem = placement_report(CFG80B, parse_rules(hybrid, "hybrid.yaml")).memory
    assert mem["cpu"]["weights"] == base["cpu"]["weights"] == EXPERT_BYTES
    assert mem["cuda:0"]["weights"] - base["cuda:0"]["weights"] == EXPERT_BYTES // 8


def test_num_gpu_experts_flag(capsys):
    """--num_gpu_experts sets `gpu_experts` on the rules' KExpertsCPU (rules show counts them on the GPU); rules
    with no KExpertsCPU decode, or a negative count, are refused naming the flag."""
    from ktrans.inject.rules import load_rules, with_gpu_experts

    base = show(capsys, "Qwen3Next-serve.yaml")["memory"]
    mem = show(capsys, "Qwen3Next-serve.yaml", "--num_gpu_experts", "128")["memory"]
    assert mem["cuda:0"]["weights"] - base["cuda:0"]["weights"] == EXPERT_BYTES // 4
    rules = with_gpu_experts(load_rules(RULES_DIR / "Qwen3Next-serve.yaml"), 7)
    assert [r.kwargs["gpu_experts"] for r in rules if r.kwargs.get("generate_op") == "KExpertsCPU"] == [7]
    with pytest.raises(ValueError, match="--num_gpu_experts: no rule of .* decodes the experts on KExpertsCPU"):
        with_gpu_experts(load_rules(RULES_DIR / "Qwen3Next-gpu.yaml"), 4)
    with pytest.raises(ValueError, match="--num_gpu_experts must be >= 0"):
        with_gpu_experts(load_rules(RULES_DIR / "Qwen3Next-serve.yaml"), -1)
    assert main(["rules", "show", "--optimize_config_path", str(RULES_DIR / "Qwen3Next-gpu.yaml"),
                 "--num_gpu_experts", "4"]) == 2
    assert "--num_gpu_experts" in capsys.readouterr().err
