"""KAttentionFlashInfer (FlashInfer's paged kernels, an optional attention backend) and what it plans from.

On any machine: the page lists it plans from (`attention.page_lists`) against hand-made block tables, a rule that
names it without FlashInfer installed fails naming the package, and the runner calls every op's `replan` before a
graph replay needs it. With CUDA and flashinfer-python (gpu-marked): the small model (head_dim 64, the smallest
FlashInfer's paged kernels take) under the gpu placement with
the op in bf16 against the torch op in fp32 (the oracle) and in bf16 (the noise floor), through a prefill over a
cached prefix, a step mixing prefill chunks with a decode row, and 64 decode steps replayed from CUDA graphs (3
sequences in the 4-row bucket: a pad row on the pad page), teacher-forced; and replayed steps bitwise equal to the
same bucket's eager steps (the same kernels and shapes).
"""
from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

from ktrans.config import RULES_DIR
from ktrans.operators.attention import ATTENTION_OPS, page_lists
from ktrans.operators.base import OpNotBuiltError
from ktrans.runtime.batch import SeqChunk

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
GPU_RULES = (RULES_DIR / "Qwen3Next-gpu.yaml").read_text()
ATTN_LINE = 'class: KQwen3NextAttention\n    kwargs: {generate_device: "cuda", prefill_device: "cuda"'


def test_page_lists_take_each_sequences_pages_in_order():
    tables = np.array([[5, 2, 9, -1],    # 33 tokens of 16: three pages, one token on the last
                       [7, -1, -1, -1],  # 16 tokens: one full page
                       [3, 4, -1, -1],   # 17 tokens
                       [8, -1, -1, -1]])  # a pad row: 2 tokens on the pad page
    indptr, ids, last = page_lists(tables, [33, 16, 17, 2], 16)
    assert indptr.tolist() == [0, 3, 4, 6, 7] and ids.tolist() == [5, 2, 9, 7, 3, 4, 8]
    assert last.tolist() == [1, 16, 1, 2]
    assert indptr.dtype == ids.dtype == last.dtype == np.int32


@pytest.mark.parametrize("lens, why", [([49], "needs 4 pages of 16, its block table row holds 3"),
                                       ([0], "a KV length of 0"), ([17, 1], "2 sequences but block tables of 1")])
def test_page_lists_refuse_lengths_the_tables_cannot_hold(lens, why):
    with pytest.raises(ValueError, match=why):
        page_lists(np.array([[1, 2, 3, -1]]), lens, 16)


@pytest.mark.skipif(HAS_FLASHINFER, reason="flashinfer is installed here")
def test_the_op_without_flashinfer_names_the_package():
    with pytest.raises(OpNotBuiltError, match="flashinfer-python"):
        ATTENTION_OPS.get("KAttentionFlashInfer")


def test_runner_replans_every_op_that_plans_for_replays(monkeypatch):
    """ModelRunner.replan (what DecodeGraphs calls before each replay) reaches each op with a `replan` once."""
    from ktrans.config import ModelConfig
    from ktrans.engine.runner import ModelRunner
    from ktrans.inject import build_injected_model
    from ktrans.model.tiny import preset_config, random_state_dict
    from ktrans.operators.attention import KAttentionTorch
    from ktrans.runtime.pools import KVPool, StatePool
    from ktrans.weights.source import StateDictSource

    seen = []
    monkeypatch.setattr(KAttentionTorch, "replan", lambda self, batch: seen.append((self.layer_idx, batch)),
                        raising=False)
    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    model, _ = build_injected_model(config, RULES_DIR / "Qwen3Next-default.yaml",
                                    StateDictSource(random_state_dict(config, 1)), torch.float32)
    runner = ModelRunner(model, KVPool(config, 8, 16), StatePool(config, 2), max_num_seqs=2, max_num_tokens=32,
                         max_pages_per_seq=4)
    runner.step([SeqChunk(list(range(3, 12)), 0, 0, [0])])
    batch = runner.prepare([SeqChunk([4], 9, 0, [0])])
    runner.replan(batch)
    assert sorted(i for i, _ in seen) == sorted(config.full_attention_layers)
    assert all(b is batch for _, b in seen)


def _small_config():
    """The small preset with head_dim 64 (its own 32 is under what FlashInfer's paged kernels take)."""
    from ktrans.config import ModelConfig
    from ktrans.model.tiny import preset_config

    return ModelConfig.from_hf_dict({**preset_config("small"), "head_dim": 64}, source="small")


def _runner(op: str, dtype: torch.dtype, graphs: bool, weights):
    from ktrans.inject import build_injected_model
    from ktrans.weights.source import StateDictSource

    from ..engine.test_graphs import _model_runner
    from ..inject.helpers import rules

    config = _small_config()
    text = GPU_RULES.replace(ATTN_LINE, f'{ATTN_LINE}, prefill_op: "{op}", generate_op: "{op}"')
    model = build_injected_model(config, rules(text, op), StateDictSource(weights), dtype)[0]
    assert type(model.model.layers[config.full_attention_layers[0]].self_attn.op).__name__ == op
    # 70-token prompts in chunks of 40, then 64 decode steps: 134 tokens, 5 pages of 32
    return _model_runner(model, graphs=graphs, max_num_tokens=64, max_pages_per_seq=5, dtype=dtype)


PROMPTS = [list(range(3, 14)), list(range(40, 110)), list(range(7, 30))]
PAGES = [[5 * i + j for j in range(5)] for i in range(3)]


def _prefill_steps(runners):
    """Prompt 0 whole with prompt 1's first 40 tokens; then prompt 1's other 30 over its cached 40 beside prompt 2
    whole and prompt 0's first decode token (a mixed step). Yields each step's fp32 logits, one tensor a runner."""
    p0, p1, p2 = PROMPTS
    steps = [[SeqChunk(p0, 0, 0, PAGES[0]), SeqChunk(p1[:40], 0, 1, PAGES[1])],
             [SeqChunk([p0[-1]], len(p0), 0, PAGES[0]), SeqChunk(p1[40:], 40, 1, PAGES[1]),
              SeqChunk(p2, 0, 2, PAGES[2])]]
    for chunks in steps:
        yield [r.step(chunks).float() for r in runners]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_FLASHINFER, reason="needs CUDA and flashinfer-python")
def test_flashinfer_op_matches_torch_op_teacher_forced():
    from ktrans.model.tiny import random_state_dict

    from ..engine.test_graphs import forced_decode

    weights = random_state_dict(_small_config(), 3)
    runners = [_runner("KAttentionTorch", torch.float32, False, weights),
               _runner("KAttentionTorch", torch.bfloat16, False, weights),
               _runner("KAttentionFlashInfer", torch.bfloat16, True, weights)]
    floor, errs = [], []
    for want, ref, got in _prefill_steps(runners):
        floor.append(float((ref - want).abs().max()))
        errs.append(float((got - want).abs().max()))
    for want, ref, got in forced_decode(runners, _continued(PROMPTS), PAGES, 64):
        floor.append(float((ref - want).abs().max()))
        errs.append(float((got - want).abs().max()) if torch.isfinite(got).all() else float("inf"))
    assert runners[2].graphs.num_replays >= 60
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    # the bf16 noise bound of tests/operators/test_gdn_triton.py: a wrong page, length or pad row is off by O(10)
    assert mean(errs) <= 1.5 * mean(floor) + 0.25, (mean(errs), mean(floor))
    assert max(errs) <= 1.5 * max(floor) + 0.25, (max(errs), max(floor))


def _continued(prompts):
    """The sequences as the prefill steps left them: prompt 0 also holds the token its decode row fed (its last,
    repeated), so its next position is len + 1."""
    return [prompts[0] + [prompts[0][-1]], *prompts[1:]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_FLASHINFER, reason="needs CUDA and flashinfer-python")
def test_flashinfer_replays_equal_the_buckets_eager_steps():
    """Identical kernels and shapes: the replayed decode steps (planned before each replay) give bitwise the logits
    of the same bucket's steps run eagerly (DecodeGraphs.capture off: padded, planned in the forward)."""
    from ktrans.model.tiny import random_state_dict

    from ..engine.test_graphs import forced_decode

    weights = random_state_dict(_small_config(), 3)
    replayed = _runner("KAttentionFlashInfer", torch.bfloat16, True, weights)
    eager = _runner("KAttentionFlashInfer", torch.bfloat16, True, weights)
    eager.graphs.capture = False
    for _ in _prefill_steps([replayed, eager]):
        pass
    for step, (a, b) in enumerate(forced_decode([replayed, eager], _continued(PROMPTS), PAGES, 24)):
        assert torch.equal(a, b), f"decode step {step}: replayed and eager logits differ"
    assert replayed.graphs.num_replays >= 20 and eager.graphs.num_replays == 0


# ---- the op's planning and integration on the CPU, against a stand-in for FlashInfer's wrappers ------------------
# The stand-in keeps FlashInfer's documented contract (plan from indptr / page ids / last-page fills, graph-mode decode
# wrappers of a fixed row count whose plan fills the buffers given at construction, causal masks aligned to the end
# of each sequence's keys, NHD pages) and computes the attention in fp32 from what it was planned with, so the op's
# outputs show whether it planned each step right.

def _attend(q, paged, qo, indptr, ids, last, page, scale):
    k_pages, v_pages = paged
    out = torch.empty_like(q)
    for i in range(len(indptr) - 1):
        pages = ids[indptr[i]: indptr[i + 1]].long()
        n_kv = (len(pages) - 1) * page + int(last[i])
        k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:n_kv].float()
        v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:n_kv].float()
        qi = q[qo[i]: qo[i + 1]].float()
        n_q, group = qi.shape[0], q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        visible = torch.arange(n_kv)[None, :] <= (n_kv - n_q + torch.arange(n_q))[:, None]
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
        out[qo[i]: qo[i + 1]] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
    return out


class _Prefill:
    plans = 0

    def __init__(self, workspace, layout):
        assert layout == "NHD"

    def plan(self, qo, indptr, ids, last, hq, hkv, d, page, causal=False, **kw):
        assert causal and qo.dtype == indptr.dtype == ids.dtype == last.dtype == torch.int32
        self.planned = (qo.clone(), indptr.clone(), ids.clone(), last.clone(), page, kw["sm_scale"])
        type(self).plans += 1

    def run(self, q, paged):
        return _attend(q, paged, *self.planned)


class _Decode:
    plans = 0
    graph_plans = 0

    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        assert layout == "NHD" and use_tensor_cores
        self.graph = use_cuda_graph
        if use_cuda_graph:  # fixed buffers, planned into
            self.indptr, self.ids = paged_kv_indptr_buffer, paged_kv_indices_buffer
            self.last = paged_kv_last_page_len_buffer
            self.rows = len(self.indptr) - 1
        else:
            assert paged_kv_indptr_buffer is None and paged_kv_indices_buffer is None

    def plan(self, indptr, ids, last, hq, hkv, d, page, **kw):
        assert indptr.dtype == ids.dtype == last.dtype == torch.int32
        if self.graph:
            assert len(indptr) - 1 == self.rows, "a graph-mode wrapper keeps its batch size"
            assert len(ids) <= len(self.ids), "more page ids than the buffer holds"
            self.indptr.copy_(indptr)
            self.ids[: len(ids)].copy_(ids)
            self.last.copy_(last)
            type(self).graph_plans += 1
        else:  # sized by each plan, from copies
            self.indptr, self.ids, self.last = indptr.clone(), ids.clone(), last.clone()
            self.rows = len(indptr) - 1
        self.page, self.scale = page, kw["sm_scale"]
        type(self).plans += 1

    def run(self, q, paged, out=None):
        qo = torch.arange(self.rows + 1, dtype=torch.int32)
        out.copy_(_attend(q, paged, qo, self.indptr, self.ids, self.last, self.page, self.scale))
        return out


@pytest.fixture
def fi_op(monkeypatch):
    """ktrans.operators.attention_flashinfer imported over the stand-in, placeable on the CPU in fp32; the registry
    and sys.modules as they were afterwards."""
    import os
    import sys
    import types

    if os.environ.get("TRITON_INTERPRET") != "1":  # on a GPU machine the real FlashInfer's tests run instead
        pytest.skip("the stand-in's runners run the Triton write_kv on the CPU: interpreted runs only")
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper, fake.BatchDecodeWithPagedKVCacheWrapper = _Prefill, _Decode
    name = "ktrans.operators.attention_flashinfer"
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.delitem(sys.modules, name, raising=False)
    info = ATTENTION_OPS.info("KAttentionFlashInfer")
    # declared only while the stand-in's module registers (a GPU run may have built the real one before), and
    # restored as it was afterwards
    monkeypatch.setitem(ATTENTION_OPS._ops, "KAttentionFlashInfer", dataclasses.replace(info, cls=None))
    module = importlib.import_module(name)
    monkeypatch.setattr(module, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(module, "HEAD_DIMS", (32, 64, 128, 256))  # the tiny models' 32
    monkeypatch.setattr(module, "DTYPES", (torch.float32, torch.bfloat16))
    monkeypatch.setattr(ATTENTION_OPS.info("KAttentionFlashInfer"), "devices", ("cuda", "cpu"))
    _Prefill.plans = _Decode.plans = _Decode.graph_plans = 0
    yield module
    sys.modules.pop(name, None)


def _cpu_runner(op: str, weights, config):
    from ktrans.engine.runner import ModelRunner
    from ktrans.inject import build_injected_model
    from ktrans.runtime.pools import KVPool, StatePool
    from ktrans.weights.source import StateDictSource

    from ..inject.helpers import rules

    text = (RULES_DIR / "Qwen3Next-default.yaml").read_text()
    assert '"KAttentionTorch"' in text
    model = build_injected_model(config, rules(text.replace('"KAttentionTorch"', f'"{op}"'), op),
                                 StateDictSource(weights), torch.float32)[0]
    return ModelRunner(model, KVPool(config, 16, 32), StatePool(config, 4), max_num_seqs=4, max_num_tokens=64,
                       max_pages_per_seq=5)


@pytest.mark.triton  # the Triton write_kv, interpreted without a GPU
def test_op_over_the_stand_in_matches_the_torch_op(fi_op):
    """The tiny model with KAttentionFlashInfer (over the stand-in) against KAttentionTorch, fp32, same schedule:
    a prefill in two chunks, a mixed step, decode steps of three sequences and a padded decode batch (a pad row on
    the pad page): the op plans each step once for all its layers, a decode step on a wrapper of its row count."""
    from ktrans.config import ModelConfig
    from ktrans.model.tiny import preset_config, random_state_dict

    # two full-attention layers: one plan a step serves both
    config = ModelConfig.from_hf_dict({**preset_config("tiny"), "full_attention_interval": 2}, source="tiny-2")
    assert len(config.full_attention_layers) == 2
    weights = random_state_dict(config, 2)
    runners = [_cpu_runner("KAttentionTorch", weights, config), _cpu_runner("KAttentionFlashInfer", weights, config)]
    steps = list(_prefill_steps(runners))
    lens, tokens = [len(PROMPTS[0]) + 1, len(PROMPTS[1]), len(PROMPTS[2])], [5, 6, 7]
    for _ in range(3):
        chunks = [SeqChunk([t], n, i, PAGES[i]) for i, (t, n) in enumerate(zip(tokens, lens))]
        steps.append([r.step(chunks) for r in runners])
        lens = [n + 1 for n in lens]
    # 1 live row + 1 pad row, as a graph bucket prepares it (kv_len_bucket: DecodeGraphs' step)
    pad = [r.prepare([SeqChunk([9], lens[0], 0, PAGES[0])], pad_to=2, kv_len_bucket=64) for r in runners]
    steps.append([r.forward(b)[:1] for r, b in zip(runners, pad)])
    for i, (want, got) in enumerate(steps):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {i}")
    assert _Prefill.plans == 2 and _Decode.plans == 4  # once a step, not once a layer
    planner = next(iter(fi_op._PLANNERS[runners[1].kv].values()))
    # the eager steps on the one plain wrapper; only the bucket's step built a graph-mode wrapper (its rows, the
    # tables' full width)
    assert _Decode.graph_plans == 1 and list(planner.graph_decodes) == [2] and planner.graph_decodes[2][0] == 5


def test_planners_go_with_their_pool(fi_op):
    """A planner is kept per KV pool weakly, and keeps its last step weakly: a dropped pool takes its planners."""
    import gc

    from ktrans.operators import gdn

    from ktrans.config import ModelConfig
    from ktrans.model.tiny import preset_config, random_state_dict

    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    runner = _cpu_runner("KAttentionFlashInfer", random_state_dict(config, 2), config)
    runner.step([SeqChunk(list(range(3, 12)), 0, 0, PAGES[0])])
    assert len(fi_op._PLANNERS) == 1
    del runner
    gdn._LAST_PLAN.clear()  # the DeltaNet's plan of the last step also holds that step's batch (and so the pool)
    gc.collect()
    assert len(fi_op._PLANNERS) == 0


@pytest.mark.triton
def test_replan_plans_a_replayed_step_into_the_same_buffers(fi_op):
    """What a graph replay relies on: replan() of a later step (same rows, longer sequences) plans again into the
    buffers the first step's wrapper was built with, once for all layers, while plan() of a step already planned
    does nothing."""
    from ktrans.config import ModelConfig
    from ktrans.model.tiny import preset_config, random_state_dict

    config = ModelConfig.from_hf_dict({**preset_config("tiny"), "full_attention_interval": 2}, source="tiny-2")
    runner = _cpu_runner("KAttentionFlashInfer", random_state_dict(config, 2), config)
    runner.step([SeqChunk(list(range(3, 40)), 0, 0, PAGES[0])])
    first = runner.prepare([SeqChunk([4], 37, 0, PAGES[0])], pad_to=1, kv_len_bucket=64)  # a graph bucket's step
    runner.forward(first)
    planner = next(iter(fi_op._PLANNERS[runner.kv].values()))
    wrapper = planner.graph_decodes[1][1]
    buffers = (wrapper.indptr.data_ptr(), wrapper.ids.data_ptr(), wrapper.last.data_ptr())
    runner.plan(first)
    assert _Decode.plans == 1
    later = runner.prepare([SeqChunk([5], 38, 0, PAGES[0])], pad_to=1, kv_len_bucket=64)  # 39 tokens: 2 pages
    runner.replan(later)
    assert _Decode.plans == 2 and planner.graph_decodes[1][1] is wrapper  # the two layers' replan: one plan
    assert (wrapper.indptr.data_ptr(), wrapper.ids.data_ptr(), wrapper.last.data_ptr()) == buffers
    assert wrapper.indptr.tolist() == [0, 2] and wrapper.ids[:2].tolist() == PAGES[0][:2]
    assert wrapper.last.tolist() == [39 - 32]


def test_workspace_fits_the_largest_bucket(fi_op):
    """FlashInfer's graph-mode split-KV partials at Qwen3-Next's shapes (16 query heads, 2 KV heads, d=256, 132 SMs):
    a padded batch of max(132, ceil(8b / 16) + b - 1) query tiles of 16 rows x 16 heads x 257 fp32 values;
    FlashInfer's 128 MiB holds b <= 340 (a 512-row bucket overran it), the runner's largest bucket sizes it past
    that."""
    size = lambda b: fi_op.workspace_bytes(b, 16, 2, 256, 132)  # noqa: E731
    assert size(1) == size(256) == 128 << 20
    per_tile = 16 * 16 * 257 * 4  # heads x tile rows x (d + 1) fp32
    assert size(512) == (256 + 511) * per_tile + (16 << 20) > 128 << 20
    assert (170 + 339) * per_tile <= 128 << 20 < (171 + 340) * per_tile < size(341)  # where 128 MiB ran out


@pytest.mark.triton
def test_graph_buckets_past_the_sizing_or_wider_tables_are_refused(fi_op):
    """A graph bucket with more rows than the runner sized the workspace for (--max_batch_size) is refused, as is a
    step whose block tables are wider than the buffers the bucket's graphs captured (a new wrapper would strand
    them); the runner passes its max_num_seqs to the op (reserve_seqs)."""
    from ktrans.config import ModelConfig
    from ktrans.model.tiny import preset_config, random_state_dict

    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    runner = _cpu_runner("KAttentionFlashInfer", random_state_dict(config, 2), config)
    op = runner.model.model.layers[config.full_attention_layers[0]].self_attn.op
    assert op.max_rows == 4
    runner.step([SeqChunk(list(range(3, 12)), 0, 0, PAGES[0])])
    planner = next(iter(fi_op._PLANNERS[runner.kv].values()))
    assert planner.max_rows == 4
    with pytest.raises(ValueError, match="5 rows, its workspace is sized for 4 .--max_batch_size"):
        planner._graph_decode(5, 5)
    planner._graph_decode(2, 5)
    with pytest.raises(ValueError, match="block tables 6 pages wide, its CUDA graphs' buffers hold 5"):
        planner._graph_decode(2, 6)


def test_a_head_dim_flashinfer_lacks_is_refused_naming_the_op(fi_op, monkeypatch):
    """The tiny model's head_dim 32 under FlashInfer's own head dims: the build fails naming the op, the head_dim and
    the op to choose instead (FlashInfer's JIT would fail later, in nvcc, on a static assertion)."""
    from ktrans.config import ModelConfig
    from ktrans.model.tiny import preset_config, random_state_dict

    monkeypatch.setattr(fi_op, "HEAD_DIMS", (64, 128, 256))
    config = ModelConfig.from_hf_dict(preset_config("tiny"), source="tiny")
    with pytest.raises(ValueError, match="KAttentionFlashInfer takes head_dim 64, 128, 256 .* this model's is 32: "
                                         "choose KAttentionTriton"):
        _cpu_runner("KAttentionFlashInfer", random_state_dict(config, 2), config)


@pytest.mark.skipif(HAS_FLASHINFER, reason="flashinfer is installed here")
def test_bench_family_is_skipped_without_flashinfer():
    from ktrans.bench import kernels

    rows = kernels.run(["flashinfer"], None, reps=1, as_json=True, device="cpu")
    assert rows == [{"family": "flashinfer", "skipped": "No module named 'flashinfer'"}]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_FLASHINFER, reason="needs CUDA and flashinfer-python")
def test_bench_family_runs_on_the_gpu():
    from ktrans.bench import kernels

    rows = kernels.run(["flashinfer"], "decode 32k B=1|prefill T=4096", reps=2, as_json=True)
    assert [r["case"] for r in rows] == ["decode 32k B=1", "prefill T=4096"]
    assert all("error" not in r and r["us"] > 0 for r in rows), rows
