"""The Triton ops in the model: the small random model with KRMSNormTriton, KRoPETriton, KAttentionTriton and
KRouterTriton against the same checkpoint with the reference ops, teacher-forced (both models fed the same
tokens, so a difference cannot compound through sampling): chunked prefill over a cached prefix, mixed prefill+decode steps and pure decode steps (the decode
kernels), pages handed out interleaved so block tables are out of order.

Tolerance (fp32 weights): every logit within 1e-4 * the largest |logit| of the step, and the same argmax wherever
the reference's top-2 margin exceeds that. Also the rule validation of the op names and a clear error for a Triton
op placed on the CPU without the interpreter.
"""
from __future__ import annotations

import re

import pytest
import torch

from ktrans.config import RULES_DIR, ModelConfig
from ktrans.inject import build_injected_model, parse_rules
from ktrans.operators.moe import gate_weight_row
from ktrans.runtime.batch import ForwardBatch, SeqChunk
from ktrans.runtime.pools import KVPool, StatePool
from ktrans.weights.hf import HFWeightSource
from tests.model.helpers import make_checkpoint

pytest.importorskip("ktrans.operators.layers_triton")
pytestmark = pytest.mark.triton

TRITON_OPS = {"KQwen3NextRMSNorm": "KRMSNormTriton", "KQwen3NextRotaryEmbedding": "KRoPETriton",
              "KQwen3NextAttention": "KAttentionTriton", "KQwen3NextSparseMoeBlock": "KRouterTriton"}
REL_TOL = 1e-4


def with_triton_ops(text: str) -> str:
    """A rule file's text with the Triton op named for both phases of the four operators that have one."""
    for operator, op in TRITON_OPS.items():
        def sub(m: re.Match, op: str = op) -> str:
            kw = re.sub(r',?\s*(generate|prefill)_op: "[^"]*"', "", m.group(3) or "").strip(", ")
            kw = (kw + ", " if kw else "") + f'generate_op: "{op}", prefill_op: "{op}"'
            return f"{m.group(1)}    kwargs: {{{kw}}}\n"

        text, n = re.subn(rf"(    class: {operator}\n)(    kwargs: \{{(.*)\}}\n)?", sub, text)
        assert n, operator
    return text


def _rules(triton: bool):
    """The default rules, or the same with the Triton ops."""
    text = (RULES_DIR / "Qwen3Next-default.yaml").read_text()
    return parse_rules(with_triton_ops(text) if triton else text, "triton-test.yaml")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "small", num_hidden_layers=4,
                           layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    config = ModelConfig.from_json(ckpt / "config.json")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = [build_injected_model(config, _rules(t), HFWeightSource(ckpt, config), torch.float32, dev)[0]
           for t in (False, True)]
    return out, dev


def _step_logits(model, kv, states, chunks, dev):
    return model(ForwardBatch.build(chunks, kv, states, device=dev))


def test_rules_name_the_triton_ops(models):
    (_, tri), dev = models
    layer = tri.model.layers[1]
    assert type(layer.self_attn.op).op_name == "KAttentionTriton"
    assert type(layer.input_layernorm.op).op_name == "KRMSNormTriton"
    assert type(layer.mlp.op).op_name == "KRouterTriton"
    x = torch.zeros(2, tri.config.hidden_size, device=dev)  # the shared expert's gate logit in the sum's launch
    assert layer.mlp.op.FUSES_GATE and gate_weight_row(layer.mlp.shared_expert_gate, x, "generate") is not None
    assert type(tri.model.rotary_emb.op).op_name == "KRoPETriton"


def test_teacher_forced_logits_match_the_reference_ops(models):
    (ref, tri), dev = models
    config = ref.config
    # Per step, how many new tokens each sequence feeds: chunked prefill over a cached prefix (5 then 3), a
    # mixed step (prefill chunks beside decode tokens), then pure decode steps; a 1-token prompt.
    plans = [[5, 3, 1, 1, 1, 1, 1], [6, 0, 1, 1, 1, 0, 1], [1, 1, 0, 0, 1, 1, 1]]
    tokens = [torch.randint(0, config.vocab_size, (sum(p),)).tolist() for p in plans]
    pools = [(KVPool(config, 3 * 4, 4, dtype=torch.float32, device=dev),
              StatePool(config, 3, dtype=torch.float32, device=dev)) for _ in range(2)]
    pages = [[i + 3 * r for r in range(4)] for i in range(3)]  # interleaved: each table's pages out of order
    done, decode_steps = [0, 0, 0], 0
    for step in range(len(plans[0])):
        chunks = []
        for i, plan in enumerate(plans):
            if plan[step]:
                chunks.append(SeqChunk(tokens[i][done[i]: done[i] + plan[step]], done[i], i, pages[i], logits="all"))
                done[i] += plan[step]
        decode_steps += all(len(c.token_ids) == 1 and c.cached_len > 0 for c in chunks)
        want = _step_logits(ref, *pools[0], chunks, dev)
        got = _step_logits(tri, *pools[1], chunks, dev)
        tol = REL_TOL * want.abs().max().item()
        assert (got - want).abs().max().item() <= tol, f"step {step}"
        top2 = want.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > tol
        assert torch.equal(got.argmax(-1)[sure], want.argmax(-1)[sure])
    assert decode_steps >= 2  # the split-K decode kernel ran, not only the varlen one


def _prefill_then_decode(model, dev) -> torch.Tensor:
    """The logits of a prefill of two prompts (one step), then three decode steps of both."""
    config = model.config
    prompts = [list(range(3, 12)), list(range(20, 26))]
    kv, states = KVPool(config, 8, 4, dtype=torch.float32, device=dev), StatePool(config, 2, device=dev)
    pages = [[0, 2, 4, 6], [1, 3, 5, 7]]
    out = [_step_logits(model, kv, states, [SeqChunk(p, 0, i, pages[i]) for i, p in enumerate(prompts)], dev)]
    for step in range(3):
        chunks = [SeqChunk([7 + step], len(p) + step, i, pages[i]) for i, p in enumerate(prompts)]
        out.append(_step_logits(model, kv, states, chunks, dev))
    return torch.cat(out)


def test_gate_in_the_decode_merge_gives_the_same_logits(models, monkeypatch):
    """KTRANS_ATTN_GATE_MERGE (the attention output gate in the decode merge's launch) changes no logit: a prefill
    then decode steps of two sequences, bitwise the logits with the gate in its own launch."""
    from ktrans.kernels.triton import attention as tri_attention

    (_, tri), dev = models
    logits = []
    for fused in (False, True):
        monkeypatch.setattr(tri_attention, "DECODE_GATE", fused)
        logits.append(_prefill_then_decode(tri, dev))
    assert torch.equal(logits[0], logits[1])


def test_attention_prep_in_one_launch_gives_the_same_logits(models, monkeypatch):
    """KTRANS_ATTN_PREP (the q/k norms, RoPE and KV write of a full-attention layer in one launch, qk_prep), alone
    and with the gate in the merge: the logits of a prefill and three decode steps within fp32 rounding of the
    unfused ops' (the norm's sum may add in another order), and qk_prep ran in each layer's steps."""
    from ktrans.kernels.triton import attention as tri_attention
    from ktrans.kernels.triton import attention_prep as tri_prep

    (_, tri), dev = models
    calls = []
    real = tri_prep.qk_prep
    monkeypatch.setattr(tri_prep, "qk_prep", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(tri_prep, "FUSED", False)  # the unfused ops (KTRANS_ATTN_PREP=0), the default's oracle
    want = _prefill_then_decode(tri, dev)
    assert not calls
    monkeypatch.setattr(tri_prep, "FUSED", True)
    for gate in (False, True):
        monkeypatch.setattr(tri_attention, "DECODE_GATE", gate)
        got = _prefill_then_decode(tri, dev)
        torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)
    assert len(calls) == 2 * 4 * sum(1 for t in tri.config.layer_types if t == "full_attention")


def test_attention_prep_fuses_only_the_triton_norms_and_rope(models, monkeypatch):
    """The fused prep repeats KRMSNormTriton's and TritonRopeTables' rounding, not the torch ops' (KRoPETorch's
    rotation differs by 1-2 bf16 ulps): with the reference's tables or a torch norm op, the layer keeps its ops."""
    from ktrans.kernels.triton import attention_prep as tri_prep
    from ktrans.operators.layers_triton import TritonRopeTables
    from ktrans.operators.norm import KRMSNormTorch
    from ktrans.operators.rope import RopeTables
    from ktrans.runtime.batch import GENERATE

    (_, tri), _ = models
    monkeypatch.setattr(tri_prep, "FUSED", True)
    attn = tri.model.layers[tri.config.full_attention_layers[0]].self_attn
    op = attn.op_for(GENERATE)
    dev = attn.q_norm.impl[GENERATE].weight.device  # as the forward names it (cuda:0, not cuda)
    cos = torch.ones(1, 8, device=dev)
    assert attn._prep(GENERATE, dev, op, TritonRopeTables(cos, cos)) is not None
    assert attn._prep(GENERATE, dev, op, RopeTables(cos, cos)) is None
    norm = attn.q_norm.impl[GENERATE]
    monkeypatch.setattr(type(norm), "PREP_EXACT", False)  # a norm op without the kernel's arithmetic
    assert attn._prep(GENERATE, dev, op, TritonRopeTables(cos, cos)) is None
    assert not getattr(KRMSNormTorch, "PREP_EXACT", False)


def test_triton_op_on_cpu_needs_the_interpreter(monkeypatch):
    from ktrans.operators.base import OpNotBuiltError
    from ktrans.operators.layers_triton import check_runs_here

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(OpNotBuiltError, match="KAttentionTriton cannot run on cpu"):
        check_runs_here("KAttentionTriton", torch.device("cpu"))


@pytest.mark.gpu
def test_decode_graphs_with_the_triton_ops_replay_like_eager():
    """The gpu placement with the Triton ops under the engine's CUDA graphs: replayed steps give the eager steps'
    greedy tokens at the same buckets (the same kernels on the same shapes), with requests joining and leaving."""
    from ktrans.model.tiny import preset_config, random_state_dict
    from ktrans.weights.source import StateDictSource
    from tests.engine.test_graphs import _serve

    config = ModelConfig.from_hf_dict(preset_config("small"), source="small")
    text = with_triton_ops((RULES_DIR / "Qwen3Next-gpu.yaml").read_text())
    model, _ = build_injected_model(config, parse_rules(text, "gpu-triton.yaml"),
                                    StateDictSource(random_state_dict(config, 3)), torch.bfloat16)
    assert type(model.model.layers[3].self_attn.op).op_name == "KAttentionTriton"
    replayed, replays = _serve(model, 3, capture=True)
    eager, _ = _serve(model, 3, capture=False)
    assert replays > 0 and replayed == eager
