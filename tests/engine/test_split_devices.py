"""A model split by layer range over two devices (Qwen3Next-serve-2gpu.yaml), on a machine without two GPUs.

The rules' two GPUs are stood in by the CPU: the model is built from the shipped 2-GPU file with its layer ranges
cut to the small model's 8 layers and every device set to cpu, while its pools are built per *placement group*
from the same file's real placement (cuda:0 for layers 0-3, cuda:1 for 4-7, found by a dry-run injection), each
part on the CPU. So the per-device pools, the shared page and slot ids and the CacheManager's copies over split
pools run for real; the hand-off between GPUs runs only in test_split_gpu.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from ktrans.config import RULES_DIR, ModelConfig
from ktrans.engine.cache import CacheManager
from ktrans.engine.runner import ModelRunner
from ktrans.inject import inject, layer_devices
from ktrans.model.source import build_model
from ktrans.runtime.batch import SeqChunk
from ktrans.runtime.pools import KVPool, SplitKVPool, SplitStatePool, StatePool, make_kv_pool, make_state_pool

from ..inject.helpers import injected, rules
from ..model.helpers import load, make_checkpoint

TOL = 1e-6  # relative to the largest logit: the same ops in the same order on the same device, so in fact equal
TWO_GPU = RULES_DIR / "Qwen3Next-serve-2gpu.yaml"
CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")


def cut_ranges(text: str, layers: int) -> str:
    """A 2-GPU rule file with its ranges 0-23 / 24-47 cut to the halves of a model of `layers` (< 20) layers."""
    half = layers // 2
    return text.replace("([0-9]|1[0-9]|2[0-3])", f"[0-{half - 1}]").replace(
        "(2[4-9]|3[0-9]|4[0-7])", f"({'|'.join(map(str, range(half, layers)))})")


def two_gpu_text(layers: int, on_cpu: bool, name: str = "Qwen3Next-serve-2gpu.yaml") -> str:
    """A shipped 2-GPU file cut to `layers`; on_cpu: every device cpu and the reference experts (exact against the
    plain model)."""
    text = cut_ranges((RULES_DIR / name).read_text(), layers)
    if on_cpu:
        text = text.replace('"cuda:0"', '"cpu"').replace('"cuda:1"', '"cpu"').replace('"KExpertsCPU"', '"KExpertsTorch"')
    return text


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("split"), "small", seed=5)


@pytest.fixture(scope="module")
def config(ckpt):
    return ModelConfig.from_json(ckpt / "config.json")


@pytest.fixture(scope="module")
def groups(config):
    """Layer -> device under the real 2-GPU rules (a dry run on the meta tree: no GPU needed)."""
    inj = inject(build_model(config), rules(two_gpu_text(config.num_hidden_layers, on_cpu=False)), dry_run=True)
    return inj.layer_devices()


@pytest.fixture(scope="module")
def models(ckpt, config):
    """(plain model, the 2-GPU placement on the CPU)."""
    split, _ = injected(ckpt, rules(two_gpu_text(config.num_hidden_layers, on_cpu=True)))
    return load(ckpt), split


def test_the_rules_split_the_layers_in_two(config, groups):
    half = config.num_hidden_layers // 2
    assert groups == {i: GPU0 if i < half else GPU1 for i in range(config.num_hidden_layers)}


def test_pools_per_device_hold_exactly_their_layers(config, groups):
    kv = make_kv_pool(config, 12, 4, torch.float32, groups, device_of=lambda d: CPU)
    st = make_state_pool(config, 5, torch.float32, groups, device_of=lambda d: CPU)
    assert isinstance(kv, SplitKVPool) and isinstance(st, SplitStatePool)
    half = config.num_hidden_layers // 2
    want_kv = [[i for i in config.full_attention_layers if i < half], [i for i in config.full_attention_layers if i >= half]]
    want_st = [[i for i in config.linear_attention_layers if i < half],
               [i for i in config.linear_attention_layers if i >= half]]
    assert [list(p.layer_index) for p in kv.parts] == want_kv and all(want_kv)
    assert [list(p.layer_index) for p in st.parts] == want_st and all(want_st)
    assert [len(p.k) for p in kv.parts] == [len(w) for w in want_kv]
    # one page numbering: every part has the pages (and the pad page) of the whole pool
    assert {(p.num_pages, p.page_size, p.pad_page) for p in kv.parts} == {(12, 4, 12)}
    assert {(p.num_slots, p.pad_slot) for p in st.parts} == {(5, 5)}
    for layer in config.full_attention_layers:
        assert kv.layer(layer)[0] is kv.part_of(layer).layer(layer)[0]
    whole = KVPool(config, 12, 4), StatePool(config, 5)
    assert kv.nbytes == whole[0].nbytes and st.nbytes == whole[1].nbytes
    with pytest.raises(KeyError):
        kv.parts[0].layer(want_kv[1][0])  # a part knows only its own layers


def test_one_device_makes_one_pool(config):
    kv = make_kv_pool(config, 4, 4, torch.float32, {i: CPU for i in range(config.num_hidden_layers)})
    assert type(kv) is KVPool and list(kv.layer_index) == config.full_attention_layers


def test_split_pools_refuse_parts_that_disagree(config):
    a = KVPool(config, 4, 4, layers=config.full_attention_layers[:1])
    with pytest.raises(ValueError, match="same pages"):
        SplitKVPool([a, KVPool(config, 5, 4, layers=config.full_attention_layers[1:])])
    with pytest.raises(ValueError, match="in two KV pools"):
        SplitKVPool([a, KVPool(config, 4, 4)])
    with pytest.raises(ValueError, match="not full-attention layers"):
        KVPool(config, 4, 4, layers=[config.linear_attention_layers[0]])


def test_cache_manager_copies_every_part(config, groups):
    st = make_state_pool(config, 4, torch.float32, groups, device_of=lambda d: CPU)
    kv = make_kv_pool(config, 6, 4, torch.float32, groups, device_of=lambda d: CPU)
    cache = CacheManager.from_pools(kv, st)
    a, b = cache.alloc_slot(), cache.alloc_slot()
    for t in (*st.conv, *st.ssm):
        t[a].normal_()
    cache.copy_slot(a, b)
    assert all(torch.equal(t[a], t[b]) for t in (*st.conv, *st.ssm)) and len(st.conv) == len(groups) - len(kv.k)
    p, q = cache.alloc_pages(2)
    for t in (*kv.k, *kv.v):
        t[p * 4: p * 4 + 4].normal_()
    cache.copy_page_rows(p, q, 3)
    assert all(torch.equal(t[q * 4: q * 4 + 3], t[p * 4: p * 4 + 3]) for t in (*kv.k, *kv.v))


# Teacher-forced steps of three sequences: chunked prefill, mixed steps (decode rows beside prefill chunks), then
# pure decode steps feeding fixed tokens (the reference's, whatever either model would pick).
PROMPTS = [[(7 * i + 3) % 500 for i in range(19)], [(5 * i + 11) % 500 for i in range(6)],
           [(3 * i + 2) % 500 for i in range(13)]]


def steps(n_decode: int) -> list[list[tuple[int, list[int], int]]]:
    """Each step: [(sequence, token ids, cached length)]."""
    fed = [[(11 * i + 7 * j + 1) % 500 for i in range(n_decode + 2)] for j in range(len(PROMPTS))]
    out = [[(0, PROMPTS[0][:8], 0), (1, PROMPTS[1], 0)],                           # prefill, seq 0 in chunks
           [(0, PROMPTS[0][8:], 8), (1, fed[1][:1], 6), (2, PROMPTS[2][:5], 0)],    # mixed
           [(0, fed[0][:1], 19), (1, fed[1][1:2], 7), (2, PROMPTS[2][5:], 5)]]      # mixed
    for s in range(1, n_decode + 1):  # pure decode
        out.append([(0, fed[0][s:s + 1], 19 + s), (1, fed[1][s + 1:s + 2], 7 + s), (2, fed[2][s - 1:s], 12 + s)])
    return out


def run_steps(model, kv, states, n_decode: int = 4, device="cpu", cuda_graph: bool = False) -> list[torch.Tensor]:
    """Logits of every step (every token's), on the CPU, through a ModelRunner as the engine builds one."""
    cache = CacheManager.from_pools(kv, states)
    pages_per_seq = kv.pages_for(19 + n_decode + 1)
    runner = ModelRunner(model, kv, states, max_num_seqs=4, max_num_tokens=32, max_pages_per_seq=pages_per_seq,
                         device=device, cuda_graph=cuda_graph)
    pages = [cache.alloc_pages(pages_per_seq) for _ in PROMPTS]
    slots = [cache.alloc_slot() for _ in PROMPTS]
    out = []
    for step in steps(n_decode):
        chunks = [SeqChunk(list(t), c, slots[i], pages[i], logits="all") for i, t, c in step]
        out.append(runner.step(chunks).float().cpu().clone())
    runner.wait_end()
    return out


def test_split_logits_equal_unsplit_through_the_runner(models, config, groups):
    plain, split = models
    assert layer_devices(split) == {i: CPU for i in range(config.num_hidden_layers)}
    whole = run_steps(plain, KVPool(config, 21, 4), StatePool(config, 3))
    parts = run_steps(split, make_kv_pool(config, 21, 4, torch.float32, groups, device_of=lambda d: CPU),
                      make_state_pool(config, 3, torch.float32, groups, device_of=lambda d: CPU))
    assert len(whole) == 7
    for a, b in zip(whole, parts):
        scale = a.abs().max()
        assert (a - b).abs().max() <= TOL * scale
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_rules_show_reports_two_gpus(capsys, tmp_path, config):
    """`ktrans rules show` of the shipped 2-GPU rules on a 48-layer checkpoint of small shapes (config.json only:
    the report reads no weights and needs no GPU): weights, KV and state split evenly between cuda:0 and cuda:1,
    the embedding on cuda:0 and the final norm and lm_head on cuda:1, the experts on the CPU."""
    from ktrans.cli import main
    from ktrans.model.tiny import preset_config

    d = preset_config("small") | {"num_hidden_layers": 48}
    (tmp_path / "config.json").write_text(json.dumps(d))
    main(["rules", "show", "--optimize_config_path", str(TWO_GPU), "--model_path", str(tmp_path), "--json",
          "--cache_lens", "1024", "--max_batch_size", "2", "--weight_dtype", "bf16"])
    rep = json.loads(capsys.readouterr().out)
    mem, rows = rep["memory"], {r["module"]: r for r in rep["modules"]}
    assert sorted(mem) == ["cpu", "cuda:0", "cuda:1"]
    c = ModelConfig.from_hf_dict(d, source="t")
    kv_layer = 2 * c.num_key_value_heads * c.head_dim * 2 * (1024 + 16)  # 64 pages and the pad page, as allocated
    assert mem["cuda:0"]["kv"] == mem["cuda:1"]["kv"] == 6 * kv_layer and mem["cpu"]["kv"] == 0
    assert mem["cuda:0"]["state"] == mem["cuda:1"]["state"] > 0 and mem["cpu"]["state"] == 0
    h, v = c.hidden_size, c.vocab_size
    # the two GPUs hold the same layers' weights, but cuda:0 the embedding and cuda:1 lm_head and the final norm
    assert mem["cuda:1"]["weights"] - mem["cuda:0"]["weights"] == 4 * h  # the final norm (f32): h * 4 bytes
    assert rows["model.embed_tokens"]["generate"].startswith("cuda:0") and rows["lm_head"]["generate"].startswith("cuda:1")
    assert rows["model.norm"]["generate"].startswith("cuda:1") and rows["lm_head"]["bytes"] == h * v * 2
    assert rows["model.layers.{0..23}.mlp.experts"]["generate"].startswith("cpu KExpertsCPU")
    assert rows["model.layers.{0..23}.mlp.experts"]["out_device"] == "cuda:0"
    assert rows["model.layers.{24..47}.mlp.experts"]["out_device"] == "cuda:1"
    assert rows["model.layers.{27,31,..,47}.self_attn"]["generate"].startswith("cuda:1")
    experts = mem["cpu"]["weights"]
    assert experts == 48 * c.num_experts * 3 * h * c.moe_intermediate_size * 2
    assert not rep["warnings"]


def test_engine_on_split_pools_generates_the_unsplit_tokens(models, groups, monkeypatch):
    """The engine itself (scheduler, prefix cache snapshots and hits, chunked prefill, batched decode) over pools
    split as the 2-GPU rules place the layers: greedy tokens equal the unsplit engine's, and a shared prefix is
    served from the cache (its DeltaNet snapshot copied between slots of both parts)."""
    import ktrans.engine.engine as engine_mod
    from ktrans.engine.engine import Engine, EngineConfig
    from ktrans.engine.sampler import SamplingParams

    from ..model.helpers import default_tokenizer

    plain, split = models
    tok = default_tokenizer()
    shared = [(13 * i + 5) % 500 for i in range(40)]
    prompts = [shared + [(3 * i + k) % 500 for i in range(5 + 7 * k)] for k in range(3)]
    config = EngineConfig(max_batch_size=2, chunk_size=24, cache_lens=256, page_size=8)
    real_make_pools = engine_mod.make_pools

    def split_pools(model, num_pages, page_size, num_slots):
        dtype = next(model.parameters()).dtype
        return (make_kv_pool(model.config, num_pages, page_size, dtype, groups, device_of=lambda d: CPU),
                make_state_pool(model.config, num_slots, dtype, groups, device_of=lambda d: CPU))

    outs, hits = [], []
    for model, make in ((plain, real_make_pools), (split, split_pools)):
        monkeypatch.setattr(engine_mod, "make_pools", make)
        engine = Engine(model, tok, config)
        assert isinstance(engine.kv, SplitKVPool) == (model is split)
        tokens = []
        for p in prompts:  # one after another, so the later ones hit the first one's prefix
            out, _ = engine.generate(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
            tokens.append(out.token_ids)
        outs.append(tokens)
        hits.append(engine.prefix_cache.stats.hit_tokens)
        assert engine.cache.num_used_pages == engine.prefix_cache.num_pages  # only the cache holds pages now
    assert outs[0] == outs[1] and all(len(t) == 6 for t in outs[0])
    assert hits[0] == hits[1] > 0


def test_devices_of_a_tree_injected_with_the_two_gpu_rules(config):
    """On the meta tree (no GPU needed): where each layer's pool part goes, which GPUs the runner keeps index
    buffers on, and that the layer containers of the second range hand their output on where they are."""
    from ktrans.engine.runner import model_gpus
    from ktrans.inject import compute_devices

    model = build_model(config)
    inject(model, rules(two_gpu_text(config.num_hidden_layers, on_cpu=False)))
    half = config.num_hidden_layers // 2
    assert layer_devices(model) == {i: GPU0 if i < half else GPU1 for i in range(config.num_hidden_layers)}
    assert set(compute_devices(model)) == {GPU0, GPU1, CPU} and model_gpus(model) == [GPU0, GPU1]
    layers = model.model.layers
    assert [layers[i]._ktrans_device for i in (0, half - 1, half, -1)] == [GPU0, GPU0, GPU1, GPU1]
    assert layers[half - 1]._ktrans_out["generate"] == GPU0 and layers[half]._ktrans_out["generate"] == GPU1
    assert model.model._ktrans_out["prefill"] == GPU1  # the last layer's output stays where the final norm runs
    assert model.lm_head.devices["generate"] == GPU1 and model.model.embed_tokens.devices["generate"] == GPU0
