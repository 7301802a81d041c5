"""Qwen3Next-gpu.yaml with the quantized GPU ops (KLinearMarlin, KExpertsMarlin) against the same rules with the
reference ops (KLinearTorch, KExpertsTorch, which dequantize the same blocks to floats), on a tiny model written as
a Q4_K_M GGUF at widths that fill whole 256-weight super-blocks (so its matrices are Q4_K / Q6_K as in the 80B file).

Interpreted (`triton`, the ops placed on the CPU): one layer's experts op, resident and streaming, 2 tokens (the
per-pair fp32 path), within 2e-5 relative Frobenius error of the reference; an F32 file, where both ops keep floats,
within 1e-6 of the reference model. The whole model is too slow interpreted: on a GPU (`gpu`), as shipped in
bfloat16, its logits teacher-forced over 8 prompt tokens then 8 decode steps are within 0.05 of the reference
rules' (both sides compute in bf16, rounded differently: weights dequantized to bf16 against fp32 dequantization
in the kernels).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("gguf")
from ktrans.config import RULES_DIR, ModelConfig  # noqa: E402
from ktrans.inject import build_injected_model, parse_rules  # noqa: E402
from ktrans.model.tiny import preset_config, random_state_dict  # noqa: E402
from ktrans.operators.base import canonical_device  # noqa: E402
from ktrans.operators.experts import EXPERT_OPS  # noqa: E402
from ktrans.operators.linear import LINEAR_OPS  # noqa: E402
from ktrans.weights.gguf_source import GGUFSource  # noqa: E402
from ktrans.weights.gguf_writer import write_gguf  # noqa: E402
from tests.kernels.test_cpu_experts_op import _all_logits, rel  # noqa: E402
from tests.model.helpers import SMALL_VOCAB  # noqa: E402

GPU_RULES = (RULES_DIR / "Qwen3Next-gpu.yaml").read_text()
TORCH_RULES = GPU_RULES.replace('"KLinearMarlin"', '"KLinearTorch"').replace('"KExpertsMarlin"', '"KExpertsTorch"')
WIDTHS = dict(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256, num_experts=8)


def test_shipped_gpu_rules_use_the_quantized_ops():
    assert '"KLinearMarlin"' in GPU_RULES and '"KExpertsMarlin"' in GPU_RULES and "KLinearTorch" not in GPU_RULES


def _gguf(tmp_path_factory, quant: str) -> tuple[ModelConfig, GGUFSource]:
    config = ModelConfig.from_hf_dict({**preset_config("tiny"), **SMALL_VOCAB, **WIDTHS}, source="tiny-256")
    path = write_gguf(tmp_path_factory.mktemp("q") / f"t-{quant}.gguf", config, random_state_dict(config, 7), quant)
    return config, GGUFSource(path)


def _models(config, source, device: str, dtype: torch.dtype):
    """(reference, quantized) models under the shipped GPU rules placed on `device`."""
    with _placeable(device):
        return [build_injected_model(config, parse_rules(r.replace('"cuda"', f'"{device}"'), "t.yaml"), source,
                                     dtype)[0] for r in (TORCH_RULES, GPU_RULES)]


@contextlib.contextmanager
def _placeable(device: str):
    """Rules place the quantized ops on CUDA only; interpreted, the tests put them on the CPU."""
    import ktrans.operators.experts_marlin  # noqa: F401  registers both ops
    import ktrans.operators.linear_marlin  # noqa: F401

    with pytest.MonkeyPatch.context() as mp:
        if device == "cpu":
            mp.setattr(LINEAR_OPS.info("KLinearMarlin"), "devices", ("cuda", "cpu"))
            mp.setattr(EXPERT_OPS.info("KExpertsMarlin"), "devices", ("cuda", "cpu"))
        yield


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    return _gguf(tmp_path_factory, "q4_k_m")


def _triton_routers(model, device: torch.device) -> None:
    """Every MoE block's router op made the Triton one (the shipped gpu rules keep the torch one): it has
    route_dense."""
    from ktrans.operators import moe
    from ktrans.operators.layers_triton import KRouterTriton

    for block in model.modules():
        if isinstance(block, moe.KQwen3NextSparseMoeBlock):
            for phase in block.impl:
                block.impl[phase] = KRouterTriton(block, device)


def _count_dense_route(monkeypatch, calls: list) -> None:
    """dense_gemv.dense_route records (rows, shared) into `calls`, then runs (its callers import it at the call)."""
    from ktrans.kernels.triton import dense_gemv

    real = dense_gemv.dense_route
    monkeypatch.setattr(dense_gemv, "dense_route",
                        lambda *a, **k: calls.append((a[0].shape[0], k.get("shared", False))) or real(*a, **k))


def _experts(config, source, op: str, device: str, streaming: bool = False):
    from ktrans.model.qwen3_next import Qwen3NextExperts
    from ktrans.operators.experts import KTransformersExperts

    with torch.device("meta"):
        orig = Qwen3NextExperts(config)
    with _placeable(device):
        experts = KTransformersExperts("model.layers.1.mlp.experts", orig, config, prefill_device=device,
                                       generate_device=device, prefill_op=op, generate_op=op)
    experts.build_ops(source)
    experts.load(source, torch.float32)
    return experts


@pytest.mark.triton
def test_experts_op_and_its_streaming_twin_against_the_reference(q4_k_m, triton_device):
    """Layer 1's experts from the Q4_K_M file: the resident op (blocks repacked at load), the streaming op (only the
    routed experts repacked, per call) and KExpertsTorch on the dequantized blocks, 2 tokens."""
    from ktrans.operators.experts_marlin import KExpertsMarlin

    config, source = q4_k_m
    dev = triton_device.type  # the GPU when there is one (Triton runs no CPU tensors there), else interpreted
    ref, ours = _experts(config, source, "KExpertsTorch", dev), _experts(config, source, "KExpertsMarlin", dev)
    assert ours.op.gate_up is not None and set(ours.op.load_report["types"]) <= {"Q4_K", "Q6_K"}
    streamed = KExpertsMarlin(ours, triton_device, streaming=True)
    streamed.source, streamed.dtype = source, torch.float32
    x = (torch.randn(2, config.hidden_size, generator=torch.Generator().manual_seed(2)) * 0.1).to(triton_device)
    ids = torch.tensor([[0, 2, 5, 7], [2, 5, 0, 6]], device=triton_device)
    w = torch.rand(ids.shape).to(triton_device)
    want = ref(x, ids, w)
    assert rel(ours(x, ids, w), want) < 2e-5
    assert rel(streamed(x, ids, w), want) < 2e-5
    assert streamed.last_stream["experts"] == 5 and streamed.gate_up is None


@pytest.mark.triton
def test_shared_expert_as_a_one_expert_moe(q4_k_m, triton_device, monkeypatch):
    """KQwen3NextMLP on three KLinearMarlin projections: steps of 1-4 rows run as a one-expert MoE (two launches of
    the MoE kernel's few-token path), longer ones through the projections. In fp32, within fp32 rounding of the
    reference rules' MLP (KLinearTorch on the dequantized blocks) and of the projections' own few-row path."""
    from ktrans.operators.moe import _GPUMLP

    config, source = q4_k_m
    ref, model = _models(config, source, triton_device.type, torch.float32)
    mlp, want_mlp = model.model.layers[0].mlp.shared_expert, ref.model.layers[0].mlp.shared_expert
    fused_rows = []
    real = _GPUMLP.__call__
    monkeypatch.setattr(_GPUMLP, "__call__", lambda self, x: (fused_rows.append(x.shape[0]), real(self, x))[1])
    g = torch.Generator().manual_seed(4)
    for rows in (1, 3, 4, 5):
        x = (torch.randn(rows, config.hidden_size, generator=g) * 0.5).to(triton_device)
        got, want = mlp(x), want_mlp(x)
        # 5 rows: the projections' tensor-core tiles, which multiply the activations rounded to bf16
        assert got.shape == want.shape and rel(got, want) < (2e-5 if rows <= 4 else 3e-2), (rows, rel(got, want))
    assert isinstance(mlp._fused["prefill"], _GPUMLP) and fused_rows == [1, 3, 4]  # 5 rows: the projections
    with monkeypatch.context() as mp:  # decode runs the same ops: it shares the stacked weights, no second copy
        mp.setattr("ktrans.operators.base.current_phase", lambda: "generate")
        mlp(x[:1])
    assert mlp._fused["generate"] is mlp._fused["prefill"] and fused_rows == [1, 3, 4, 1]
    x = (torch.randn(2, config.hidden_size, generator=g) * 0.5).to(triton_device)
    fused = mlp(x)
    mlp._fused["prefill"] = None  # the projections' path for the same rows: another kernel, as close
    assert rel(fused, mlp(x)) < 2e-5 and fused_rows == [1, 3, 4, 1, 2]


@pytest.mark.triton
def test_shared_expert_fused_into_the_routed_moe(q4_k_m, triton_device, monkeypatch):
    """KTRANS_MOE_FUSED_SHARED: each MoE block whose shared expert has the routed experts' types and shapes runs a
    decode step as one MoE over k + 1 pairs (router and shared gate in one GEMV, one top-k launch, the shared expert
    as the extra pair); fp32, within fp32 rounding of the unfused block (2e-5). A block whose types differ keeps the
    unfused path, and so do steps past the lanes path."""
    from ktrans.operators import moe

    config, source = q4_k_m
    _, model = _models(config, source, triton_device.type, torch.float32)
    g = torch.Generator().manual_seed(5)
    fused_layers = 0
    for layer in model.model.layers:
        block = layer.mlp
        if not isinstance(block, moe.KQwen3NextSparseMoeBlock):
            continue
        x = (torch.randn(3, config.hidden_size, generator=g) * 0.5).to(triton_device)
        monkeypatch.setattr(moe, "FUSED_SHARED", False)
        want = block(x)
        monkeypatch.setattr(moe, "FUSED_SHARED", True)
        got = block(x)
        plan = block._shared_fused["prefill"]
        experts = block.experts.impl["prefill"]
        sh = block.shared_expert.gate_proj.impl["prefill"].packed_weight()
        same = sh is not None and sh.qtype == experts.gate_up.qtype and \
            block.shared_expert.down_proj.impl["prefill"].packed_weight().qtype == experts.down.qtype
        assert (plan is not None) == same, block.key
        assert got.shape == want.shape and rel(got, want) < 2e-5, (block.key, rel(got, want))
        if plan is not None:
            fused_layers += 1
            last = (block, plan, x)
    assert fused_layers > 0
    block, plan, x = last
    plan.max_rows = 2  # a step past the lanes path takes the unfused path
    monkeypatch.setattr(moe, "FUSED_SHARED", False)
    want = block(x)
    monkeypatch.setattr(moe, "FUSED_SHARED", True)
    assert torch.equal(block(x), want)


@pytest.mark.triton
def test_router_gemv_and_top_k_in_one_launch(q4_k_m, triton_device, monkeypatch):
    """KTRANS_ROUTER_FUSED: a decode step's router logits and their top-k (with KTRANS_MOE_FUSED_SHARED, in the
    second block, the stacked gate's and the k + 1 pairs') in one launch (dense_gemv.dense_route) give the MoE
    block's output within fp32 rounding (2e-5) of the two launches; steps past the dense GEMV's rows keep the two.
    The first two blocks: each interpreted block step takes ~4 s."""
    from ktrans.kernels.triton import dense_gemv
    from ktrans.operators import moe

    config, source = q4_k_m
    with _placeable(triton_device.type):  # the quantized model alone: no reference is compared here
        rules = parse_rules(GPU_RULES.replace('"cuda"', f'"{triton_device.type}"'), "t.yaml")
        model = build_injected_model(config, rules, source, torch.float32)[0]
    _triton_routers(model, triton_device)
    calls = []
    _count_dense_route(monkeypatch, calls)
    g = torch.Generator().manual_seed(6)
    blocks = [m for m in model.modules() if isinstance(m, moe.KQwen3NextSparseMoeBlock)][:2]
    for fused_shared, block in zip((False, True), blocks):
        monkeypatch.setattr(moe, "FUSED_SHARED", fused_shared)
        for rows in (3,) if fused_shared else (3, dense_gemv.MAX_ROWS + 1):
            x = (torch.randn(rows, config.hidden_size, generator=g) * 0.5).to(triton_device)
            monkeypatch.setattr(moe, "ROUTER_FUSED", False)
            want = block(x)
            monkeypatch.setattr(moe, "ROUTER_FUSED", True)
            got = block(x)
            assert got.shape == want.shape and rel(got, want) < 2e-5, (block.key, rows, rel(got, want))
    # a shared expert fused where its types are the routed experts' (test_shared_expert_fused_into_the_routed_moe)
    assert len(blocks) >= 2 and [c[0] for c in calls] == [3] * len(blocks) and (3, True) in calls, calls


@pytest.mark.triton
def test_deltanet_projections_paired_in_one_launch(q4_k_m, triton_device):
    """KTRANS_GEMV_PAIR: a DeltaNet layer's one-row in_proj_ba and the stored part of in_proj_qkvz of its type (here
    attn_gate, attn_qkv having more bits) in one GEMV launch give what the separate projections give, within fp32
    rounding (the launch splits K for the two together)."""
    from ktrans.operators.gdn import KQwen3NextGatedDeltaNet

    config, source = q4_k_m
    _, model = _models(config, source, triton_device.type, torch.float32)
    layers = [m for m in model.modules() if isinstance(m, KQwen3NextGatedDeltaNet)]
    x = (torch.randn(1, config.hidden_size, generator=torch.Generator().manual_seed(6)) * 0.5).to(triton_device)
    dev = torch.device(canonical_device(triton_device))  # the modules' own form of it ('cuda' is 'cuda:0')
    for gdn in layers:
        pair = gdn._pair("generate", dev)
        assert pair is not None, gdn.key
        mats, (i, j), rows = pair
        assert len(mats) == 3 and (i, j) == (1, 2) and mats[0].qtype != mats[2].qtype  # attn_gate with ssm_ba
        got = gdn._paired_projections(x, pair)
        mixed, z = gdn._stored_qkvz(x, "generate", dev)
        want = (mixed, z.view(1, gdn.num_v_heads, gdn.head_v_dim), *gdn.split_ba(gdn.in_proj_ba(x)))
        for g, w in zip(got, want):
            assert g.shape == w.shape and rel(g, w) < 1e-5, gdn.key


@pytest.mark.triton
def test_attention_projections_paired_in_one_launch(q4_k_m, triton_device):
    """KTRANS_GEMV_PAIR: an attention layer's one-row q/k/v with the two of one type and width (here k_proj and
    v_proj, both Q8_0 beside a Q4_K q_proj) in one GEMV launch give what the three projections give, within fp32
    rounding."""
    from ktrans.operators.attention import KQwen3NextAttention
    from ktrans.operators.linear_marlin import run_pair_plan

    config, source = q4_k_m
    _, model = _models(config, source, triton_device.type, torch.float32)
    layers = [m for m in model.modules() if isinstance(m, KQwen3NextAttention)]
    x = (torch.randn(1, config.hidden_size, generator=torch.Generator().manual_seed(8)) * 0.5).to(triton_device)
    assert layers
    dev = torch.device(canonical_device(triton_device))  # the modules' own form of it ('cuda' is 'cuda:0')
    for att in layers:
        plan = att._pair_plan("generate", dev)
        assert plan is not None and plan[1] == (1, 2), att.key
        got = run_pair_plan(x, plan)
        want = [lin(x) for lin in (att.q_proj, att.k_proj, att.v_proj)]
        for g, w in zip(got, want):
            assert g.shape == w.shape and rel(g, w) < 1e-5, att.key


@pytest.fixture(scope="module")
def q8_0(tmp_path_factory):
    return _gguf(tmp_path_factory, "q8_0")


@pytest.mark.triton
@pytest.mark.parametrize("quant, parts", [("q4_k_m", 2), ("q8_0", 1)])
def test_deltanet_projection_in_stored_order(quant, parts, request, triton_device, monkeypatch):
    """The split GGUF's in_proj_qkvz (attn_qkv = [q | k | v] of all heads, attn_gate = z) on KLinearMarlin: forward
    gives HF's per-key-head order (within fp32 rounding of the reference rules' KLinearTorch), forward_stored the
    stored tensors' columns, equal to forward's regrouped; and the DeltaNet layer that takes them as they are (no
    regroup, no concatenation) gives bitwise what it gives through HF's order. Every DeltaNet layer: of the tiny
    Q4_K_M file, whose attn_qkv is Q6_K beside a Q4_K attn_gate (two matrices), and of a Q8_0 file (one matrix of
    both tensors' rows)."""
    from ktrans.runtime.batch import ForwardBatch, SeqChunk
    from ktrans.runtime.pools import KVPool, StatePool

    config, source = request.getfixturevalue(quant)
    ref, model = _models(config, source, triton_device.type, torch.float32)
    g = torch.Generator().manual_seed(6)
    kinds = set()
    for layer, want_layer in zip(model.model.layers, ref.model.layers):
        if not hasattr(layer, "linear_attn"):
            continue
        gdn, lin = layer.linear_attn, layer.linear_attn.in_proj_qkvz
        op = lin.op
        kinds.add(len(op.parts))
        x = (torch.randn(3, config.hidden_size, generator=g) * 0.5).to(triton_device)
        hf = lin(x)
        assert rel(hf, want_layer.linear_attn.in_proj_qkvz(x)) < 2e-5 and op.stored_rows is not None
        mixed, z = op.forward_stored(x)
        q, k, v, zz, _, _ = gdn.split_projections(hf, torch.zeros(3, 2 * gdn.num_v_heads, device=triton_device))
        assert torch.equal(mixed, torch.cat((q.reshape(3, -1), k.reshape(3, -1), v.reshape(3, -1)), dim=-1))
        assert torch.equal(z.reshape(zz.shape), zz)
        assert gdn._stored_qkvz(x, "prefill", x.device) is not None  # the layer takes the stored order
        outs = []
        for stored in (True, False):
            if not stored:
                monkeypatch.setattr(type(gdn), "_stored_qkvz", lambda *a: None)
            kv = KVPool(config, 4, 16, torch.float32, triton_device)
            states = StatePool(config, 2, torch.float32, triton_device)
            batch = ForwardBatch.build([SeqChunk(list(range(3)), 0, 0, [0])], kv, states, device=triton_device)
            with batch.active():
                outs.append(gdn(x, batch))
        monkeypatch.undo()
        assert torch.equal(outs[0], outs[1])
    assert kinds == {parts}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["as shipped", "fused shared expert", "paired projections", "fused router"])
def test_model_teacher_forced_on_the_gpu(q4_k_m, variant, monkeypatch):
    """Variants: KTRANS_MOE_FUSED_SHARED (decode rows: the shared expert inside the routed MoE's launches),
    KTRANS_GEMV_PAIR (a DeltaNet's in_proj_ba with a part of in_proj_qkvz, and two of an attention layer's q/k/v, in
    one GEMV launch), KTRANS_ROUTER_FUSED (the router's GEMV and top-k in one launch)."""
    from ktrans.operators import gdn, linear, moe

    fused_shared = variant == "fused shared expert"
    monkeypatch.setattr(moe, "FUSED_SHARED", fused_shared)
    monkeypatch.setattr(moe, "ROUTER_FUSED", variant == "fused router")
    monkeypatch.setattr(linear, "GEMV_PAIR", variant == "paired projections")
    routed = []  # the fused router's calls: it must be taken, not fall back
    _count_dense_route(monkeypatch, routed)
    config, source = q4_k_m
    ref, model = _models(config, source, "cuda", torch.bfloat16)
    if variant == "fused router":
        _triton_routers(model, torch.device("cuda"))
    layer = model.model.layers[0]
    assert type(layer.mlp.experts.op).__name__ == "KExpertsMarlin" and layer.mlp.experts.op.gate_up is not None
    assert set(layer.mlp.experts.op.load_report["types"]) <= {"Q4_K", "Q6_K"}
    assert layer.mlp.shared_expert.up_proj.op.parts[0].packed is not None  # the blocks, not floats
    prompt = torch.randint(0, config.vocab_size, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    err = rel(_all_logits(model, prompt), _all_logits(ref, prompt))
    assert err < 0.05, err
    assert not fused_shared or any(b._shared_fused.get("generate") for b in model.modules()
                                   if isinstance(b, moe.KQwen3NextSparseMoeBlock))
    assert variant != "paired projections" or any(m._pairs.get("generate") for m in model.modules()
                                                  if isinstance(m, gdn.KQwen3NextGatedDeltaNet))
    assert (variant == "fused router") == bool(routed), routed


def test_float_checkpoint_runs_as_the_reference(tmp_path_factory):
    """An F32 GGUF: both quantized ops keep floats and compute what the reference ops compute (no Triton kernel
    runs, but the ops' modules import triton)."""
    pytest.importorskip("triton")
    config, source = _gguf(tmp_path_factory, "f32")
    ref, model = _models(config, source, "cpu", torch.float32)
    assert model.model.layers[0].mlp.experts.op.gate_up is None
    prompt = list(range(5, 17))
    assert rel(_all_logits(model, prompt), _all_logits(ref, prompt)) < 1e-6
