"""Operators one by one against the math of the modules they replace (written out here, as HF writes it), the op
registries, devices and the batch seams."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ktrans.config import ModelConfig
import torch.nn.functional as F

from ktrans.kernels.torch.moe import moe_experts
from ktrans.model.qwen3_next import (Qwen3NextExperts, Qwen3NextMLP, Qwen3NextRMSNorm, Qwen3NextRotaryEmbedding,
                                     Qwen3NextSparseMoeBlock)
from ktrans.model.tiny import preset_config
from ktrans.operators.base import OpNotBuiltError, OpRegistry, Op, canonical_device, move
from ktrans.operators.embedding import KEmbedding
from ktrans.operators.experts import KTransformersExperts
from ktrans.operators.linear import LINEAR_OPS, KLinearTorch, KTransformersLinear
from ktrans.operators.moe import KQwen3NextMLP, KQwen3NextSparseMoeBlock
from ktrans.operators.norm import KQwen3NextRMSNorm
from ktrans.operators.rope import KQwen3NextRotaryEmbedding
from ktrans.runtime.batch import ForwardBatch, SeqChunk, current_batch, current_phase
from ktrans.runtime.pools import KVPool, StatePool
from ktrans.weights.source import StateDictSource, WeightError

CFG = ModelConfig.from_hf_dict(preset_config("small"))


def ready(op_class, key, plain: nn.Module, **kwargs):
    """The operator for `plain`, loaded from plain's own (randomised) weights."""
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_()
    source = StateDictSource({f"{key}.{n}": p.detach() for n, p in plain.named_parameters()})
    op = op_class(key, plain, CFG, **kwargs)
    op.build_ops(source)
    op.load(source, torch.float32)
    return op


def test_linear_norm_embedding_rope_equal_their_math():
    x = torch.randn(7, CFG.hidden_size)
    lin = nn.Linear(CFG.hidden_size, 24, bias=True)
    assert torch.equal(ready(KTransformersLinear, "l", lin)(x), lin(x))
    norm = Qwen3NextRMSNorm(CFG.hidden_size)
    op = ready(KQwen3NextRMSNorm, "n", norm)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + norm.weight)
    torch.testing.assert_close(op(x), want, rtol=1e-6, atol=1e-6)
    emb = nn.Embedding(50, 8)
    ids = torch.tensor([0, 49, 3])
    assert torch.equal(ready(KEmbedding, "e", emb)(ids), emb(ids))
    rope = ready(KQwen3NextRotaryEmbedding, "r", Qwen3NextRotaryEmbedding(CFG))
    pos = torch.arange(11)
    cos, sin = rope(pos, torch.float32)
    dim = CFG.rotary_dim
    inv_freq = 1.0 / CFG.rope_theta ** (torch.arange(0, dim, 2).double() / dim)
    angles = pos.double()[:, None] * inv_freq[None, :]
    torch.testing.assert_close(cos, torch.cat((angles, angles), -1).cos().float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, torch.cat((angles, angles), -1).sin().float(), rtol=0, atol=1e-5)


def test_plain_modules_are_skeletons():
    """The HF-named classes hold structure only: their math is their operator's."""
    for module, args in ((Qwen3NextRMSNorm(8), (torch.zeros(1, 8),)), (Qwen3NextMLP(CFG, 8), (torch.zeros(1, 8),)),
                         (Qwen3NextExperts(CFG), (torch.zeros(1, 8), None, None))):
        with pytest.raises(RuntimeError, match="skeleton; its math is its operator's"):
            module(*args)


def _swiglu(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def test_moe_block_computes_routing_experts_and_gated_shared_expert():
    block = Qwen3NextSparseMoeBlock(CFG)
    key = "model.layers.0.mlp"
    op = ready(KQwen3NextSparseMoeBlock, key, block)  # its children are the plain Linears and MLPs
    src = StateDictSource({f"{key}.{n}": p.detach() for n, p in block.named_parameters()})
    for name, cls in (("experts", KTransformersExperts), ("shared_expert", KQwen3NextMLP)):
        child = cls(f"{key}.{name}", getattr(block, name), CFG)  # as a rule would replace them
        child.build_ops(src)
        child.load(src, torch.float32)
        setattr(op, name, child)
    x = torch.randn(9, CFG.hidden_size)
    probs = torch.softmax(x @ block.gate.weight.T, dim=-1)
    w, ids = probs.topk(CFG.num_experts_per_tok, dim=-1)
    if CFG.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    stacked = [torch.stack([getattr(e, p).weight for e in block.experts]) for p in ("gate_proj", "up_proj", "down_proj")]
    se = block.shared_expert
    want = (moe_experts(x, ids, w, *stacked)
            + torch.sigmoid(x @ block.shared_expert_gate.weight.T)
            * _swiglu(x, se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight))
    torch.testing.assert_close(op(x), want.detach(), rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_experts_submit_sync_protocol_and_decode_form():
    experts = ready(KTransformersExperts, "e", Qwen3NextExperts(CFG))
    x = torch.randn(5, CFG.hidden_size)
    ids = torch.randint(0, CFG.num_experts, (5, CFG.num_experts_per_tok))
    w = torch.rand(5, CFG.num_experts_per_tok)
    experts.submit(x, ids, w)
    out = experts.sync()
    weights = experts.op_for("generate").w
    ref = moe_experts(x.double(), ids, w.double(), *(weights[p].double() for p in ("gate_proj", "up_proj", "down_proj")))
    atol = 1e-6 * ref.abs().max().item()  # fp32 against fp64 on N(0, 1) weights: large outputs
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=atol)
    # A decode step gathers each token's experts (no host read): the same numbers as the grouped prefill form.
    kv, states = KVPool(CFG, 5, 8), StatePool(CFG, 5)
    decode = ForwardBatch.build([SeqChunk([1], 3, i, [i]) for i in range(5)], kv, states)
    with decode.active():
        experts.submit(x, ids, w)
        torch.testing.assert_close(experts.sync(), out, rtol=1e-5, atol=atol)
    with pytest.raises(RuntimeError, match="sync\\(\\) without submit\\(\\)"):
        experts.sync()
    op = experts.op_for("prefill")
    op.submit(x, ids, w)
    with pytest.raises(RuntimeError, match="submit\\(\\) called twice without sync\\(\\)"):
        op.submit(x, ids, w)


def test_mlp_computes_swiglu():
    mlp = Qwen3NextMLP(CFG, 40)
    op = KQwen3NextMLP("m", mlp, CFG)  # composite: its children stay plain Linears here
    x = torch.randn(3, CFG.hidden_size)
    assert torch.equal(op(x), _swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))


def test_phase_picks_the_op():
    counted = []

    @LINEAR_OPS.register("KLinearProbe", devices=("cpu",))
    class KLinearProbe(KLinearTorch):
        def forward(self, x):
            counted.append(x.shape[0])
            return super().forward(x)

    try:
        lin = ready(KTransformersLinear, "l", nn.Linear(CFG.hidden_size, 4), generate_op="KLinearProbe")
        assert lin.impl["prefill"] is not lin.impl["generate"]
        assert set(dict(lin.named_children())) == {"prefill_op", "generate_op"}
        x = torch.randn(1, CFG.hidden_size)
        lin(x)
        assert counted == []  # outside a forward: prefill
        kv, states = KVPool(CFG, 2, 8), StatePool(CFG, 1)
        decode = ForwardBatch.build([SeqChunk([5], 3, 0, [0])], kv, states)
        prefill = ForwardBatch.build([SeqChunk([5, 6], 0, 0, [0])], kv, states)
        with decode.active():
            assert current_batch() is decode and current_phase() == "generate"
            lin(x)
            with prefill.active():
                assert current_phase() == "prefill"
                lin(x)
            assert current_phase() == "generate"
        assert counted == [1] and current_batch() is None
    finally:
        LINEAR_OPS._ops.pop("KLinearProbe")


def test_operator_construction_errors():
    lin = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="KLinearMarlin cannot run on cpu: it runs on cuda only"):
        KTransformersLinear("l", lin, CFG, generate_op="KLinearMarlin")
    with pytest.raises(ValueError, match="unknown linear op 'Nope'"):
        KTransformersLinear("l", lin, CFG, prefill_op="Nope")
    with pytest.raises(TypeError, match="unknown kwargs \\['speed'\\]"):
        KTransformersLinear("l", lin, CFG, speed=3)
    with pytest.raises(ValueError, match="has no ops to choose"):
        KQwen3NextMLP("m", Qwen3NextMLP(CFG, 8), CFG, prefill_op="KLinearTorch")
    with pytest.raises(RuntimeError, match="has no ops; build the model with"):
        KTransformersLinear("l", lin, CFG)(torch.randn(1, 4))


def test_op_registry():
    reg = OpRegistry("demo")

    @reg.register("KDemoTorch", devices=("cpu", "cuda"), aliases=("KDemoOld",))
    class KDemoTorch(Op):
        pass

    reg.declare("KDemoFast", devices=("cuda",), module="ktrans.no_such_module", provided_by="issue 99")
    assert reg.get("KDemoOld") is KDemoTorch and reg.canonical("KDemoOld") == "KDemoTorch"
    assert reg.info("KDemoFast").devices == ("cuda",) and not reg.built("KDemoFast")
    with pytest.raises(OpNotBuiltError, match="demo op KDemoFast is not built yet: it comes with issue 99. "
                                              "Use one of the built ops: KDemoTorch"):
        reg.get("KDemoFast")
    with pytest.raises(KeyError, match="unknown demo op 'KDemoNone'"):
        reg.get("KDemoNone")
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("KDemoTorch", devices=("cpu",))(type("Other", (Op,), {}))

    @reg.register("KDemoFast", devices=("cuda",))  # the later module registering the declared op
    class KDemoFast(Op):
        pass

    assert reg.get("KDemoFast") is KDemoFast


def test_devices_and_moves():
    assert canonical_device("cuda") == "cuda:0" and canonical_device("CUDA:1") == "cuda:1"
    assert canonical_device(torch.device("cpu")) == "cpu"
    for bad in ("gpu", "cuda:x", "mps"):
        with pytest.raises(ValueError, match="unknown device"):
            canonical_device(bad)
    t = torch.ones(2)
    assert move(t, torch.device("cpu")) is t
    moved = move((t, [t], 3), torch.device("meta"))
    assert moved[0].is_meta and moved[1][0].is_meta and moved[2] == 3


def test_batch_on_another_device_is_cached_and_shares_pools():
    kv, states = KVPool(CFG, 4, 8), StatePool(CFG, 2)
    batch = ForwardBatch.build([SeqChunk([1, 2, 3], 0, 0, [0]), SeqChunk([4], 5, 1, [1, 2])], kv, states)
    assert batch.on("cpu") is batch and batch.phase == "prefill"
    meta = batch.on("meta")
    assert meta is batch.on(torch.device("meta")) and meta.on("cpu") is batch  # one copy per device per step
    for f in ("input_ids", "positions", "state_slots", "block_tables", "slot_mapping", "logits_indices"):
        assert getattr(meta, f).is_meta and getattr(meta, f).shape == getattr(batch, f).shape
    assert meta.kv is kv and meta.states is states and meta.seq_lens == batch.seq_lens
    assert meta.cu_seqlens.tolist() == [0, 3, 4]


def test_weight_sources(tmp_path):
    src = StateDictSource({"a.weight": torch.ones(2, 3)})
    with pytest.raises(WeightError, match="checkpoint is missing tensor 'b.weight' \\(shape \\(2, 3\\)\\)"):
        src.require("b.weight", (2, 3), torch.float32)
    with pytest.raises(WeightError, match="tensor 'a.weight' has shape \\(2, 3\\), expected \\(3, 2\\)"):
        src.require("a.weight", (3, 2), torch.float32)
    assert src.require("a.weight", (2, 3), torch.bfloat16).dtype == torch.bfloat16
    from ktrans.weights.hf import HFWeightSource

    from ..model.helpers import make_checkpoint

    ckpt = make_checkpoint(tmp_path, "small", tie_word_embeddings=True)
    hf = HFWeightSource(ckpt, ModelConfig.from_json(ckpt / "config.json"))
    assert torch.equal(hf.get("lm_head.weight"), hf.get("model.embed_tokens.weight"))  # tied
    raw = hf.get_raw_experts(1, "down")
    assert raw.shape == (CFG.num_experts, CFG.hidden_size, CFG.moe_intermediate_size) and raw.type_name == "F32"
    assert raw.data.dtype == torch.uint8 and raw.data.shape[-1] == CFG.moe_intermediate_size * 4
    expert3 = raw.data[3].view(torch.float32)
    assert torch.equal(expert3, hf.get("model.layers.1.mlp.experts.3.down_proj.weight"))


def test_plans_come_from_host_lists():
    """DeltaNet's batching policy and attention's metadata, planned once per step from the batch's host lists."""
    from ktrans.operators.gdn import plan_deltanet

    kv, states = KVPool(CFG, 8, 8), StatePool(CFG, 4)
    mixed = ForwardBatch.build([SeqChunk([1], 5, 3, [0]), SeqChunk([1, 2, 3], 0, 1, [1]), SeqChunk([4], 2, 0, [2]),
                                SeqChunk([5, 6], 4, 2, [3])], kv, states)
    p = plan_deltanet(mixed, torch.device("cpu"))
    assert p.decode_rows.tolist() == [0, 4] and p.decode_slots.tolist() == [3, 0]
    assert p.prefill == [(1, 4, 1, True), (5, 7, 2, False)]  # (start, end, slot, starts from zero state)
    decode = ForwardBatch.build([SeqChunk([1], 5, 3, [0]), SeqChunk([4], 2, 0, [2])], kv, states)
    p = plan_deltanet(decode, torch.device("cpu"))
    assert p.decode_rows == slice(None) and p.decode_slots is decode.state_slots and p.prefill == []
    assert plan_deltanet(ForwardBatch.build([SeqChunk([1, 2], 0, 1, [1])], kv, states),
                         torch.device("cpu")).decode_rows is None
