"""Operators one by one against the plain modules they replace, the op registries, devices and the batch seams."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ktrans.config import ModelConfig
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


def test_linear_norm_embedding_rope_equal_plain():
    x = torch.randn(7, CFG.hidden_size)
    lin = nn.Linear(CFG.hidden_size, 24, bias=True)
    assert torch.equal(ready(KTransformersLinear, "l", lin)(x), lin(x))
    norm = Qwen3NextRMSNorm(CFG.hidden_size)
    assert torch.equal(ready(KQwen3NextRMSNorm, "n", norm)(x), norm(x))
    emb = nn.Embedding(50, 8)
    ids = torch.tensor([0, 49, 3])
    assert torch.equal(ready(KEmbedding, "e", emb)(ids), emb(ids))
    rope = Qwen3NextRotaryEmbedding(CFG)
    pos = torch.arange(11)
    for a, b in zip(ready(KQwen3NextRotaryEmbedding, "r", rope)(pos, torch.float32), rope(pos, torch.float32)):
        assert torch.equal(a, b)


def test_moe_block_equals_plain_with_async_experts():
    block = Qwen3NextSparseMoeBlock(CFG)
    key = "model.layers.0.mlp"
    op = ready(KQwen3NextSparseMoeBlock, key, block)  # its children are still the plain ones
    # Replace the experts the way a rule would: the block then submits them and syncs after the shared expert.
    src = StateDictSource({f"{key}.{n}": p.detach() for n, p in block.named_parameters()})
    op.experts = KTransformersExperts(f"{key}.experts", block.experts, CFG)
    op.experts.build_ops(src)
    op.experts.load(src, torch.float32)
    x = torch.randn(9, CFG.hidden_size)
    torch.testing.assert_close(op(x), block(x), rtol=0, atol=0)


def test_experts_submit_sync_protocol():
    experts = ready(KTransformersExperts, "e", Qwen3NextExperts(CFG))
    x = torch.randn(5, CFG.hidden_size)
    ids = torch.randint(0, CFG.num_experts, (5, CFG.num_experts_per_tok))
    w = torch.rand(5, CFG.num_experts_per_tok)
    experts.submit(x, ids, w)
    out = experts.sync()
    torch.testing.assert_close(out, _plain_experts(experts)(x, ids, w), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="sync\\(\\) without submit\\(\\)"):
        experts.sync()
    op = experts.op_for("prefill")
    op.submit(x, ids, w)
    with pytest.raises(RuntimeError, match="submit\\(\\) called twice without sync\\(\\)"):
        op.submit(x, ids, w)


def _plain_experts(op: KTransformersExperts) -> Qwen3NextExperts:
    plain = Qwen3NextExperts(CFG)
    w = op.op_for("generate").w
    with torch.no_grad():
        for e, mlp in enumerate(plain):
            mlp.gate_proj.weight.copy_(w["gate_proj"][e])
            mlp.up_proj.weight.copy_(w["up_proj"][e])
            mlp.down_proj.weight.copy_(w["down_proj"][e])
    return plain


def test_mlp_equals_plain():
    mlp = Qwen3NextMLP(CFG, 40)
    op = KQwen3NextMLP("m", mlp, CFG)  # composite: its children stay plain Linears here
    x = torch.randn(3, CFG.hidden_size)
    assert torch.equal(op(x), mlp(x))


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
