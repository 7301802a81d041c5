"""KExpertsSplit (prefill of the routed experts split between the CPU op and the GPU's Triton MoE, the GPU's share
streamed from the CPU op's buffers) on a tiny Q4_K_M GGUF at widths of whole super-blocks (8 experts, Q4_K gate/up,
Q4_K or Q6_K down, as in the 80B file).

Interpreted (`triton`, the op placed on the CPU): against KExpertsTorch on the dequantized blocks within OP_TOL (the
CPU kernels' int8 activations and the GPU kernels' bf16 dots each cost ~1%), at every CPU share from none to all; the
GPU share read back from the CPU op's 16-row repacked buffers equals the one read from plain rows exactly; a step
below gpu_prefill_min_tokens is the CPU op's own result; layer 1 uses the copy layer 0 started, and gives what a
copy made on the spot gives. On a GPU (`gpu`): the same with the copy stream held back by a spin before every copy
(the compute stream must wait for it; the planes of two layers alternate), over several steps.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("gguf")
from ktrans.operators.experts import EXPERT_OPS, KTransformersExperts  # noqa: E402
from tests.kernels.test_cpu_experts_op import rel  # noqa: E402
from tests.operators.test_gpu_quant_rules import _gguf  # noqa: E402

pytestmark = pytest.mark.triton
OP_TOL = 0.03


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    return _gguf(tmp_path_factory, "q4_k_m")


@contextlib.contextmanager
def _placeable(device: str):
    import ktrans.operators.experts_split  # noqa: F401  registers the op

    with pytest.MonkeyPatch.context() as mp:
        if device == "cpu":
            mp.setattr(EXPERT_OPS.info("KExpertsSplit"), "devices", ("cuda", "cpu"))
        yield


def _experts(config, source, layer: int, device: str, prefill_op: str = "KExpertsSplit", **options):
    from ktrans.model.qwen3_next import Qwen3NextExperts

    with torch.device("meta"):
        orig = Qwen3NextExperts(config)
    with _placeable(device):
        experts = KTransformersExperts(f"model.layers.{layer}.mlp.experts", orig, config, prefill_device=device,
                                       generate_device="cpu", prefill_op=prefill_op, generate_op="KExpertsCPU",
                                       **options)
        experts.build_ops(source)
        experts.load(source, torch.float32)
    return experts


def _reference(config, source, layer: int):
    from ktrans.model.qwen3_next import Qwen3NextExperts

    with torch.device("meta"):
        orig = Qwen3NextExperts(config)
    ref = KTransformersExperts(f"model.layers.{layer}.mlp.experts", orig, config, prefill_op="KExpertsTorch",
                               generate_op="KExpertsTorch")
    ref.build_ops(source)
    ref.load(source, torch.float32)
    return ref


def _batch(config, t: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    e, k = config.num_experts, config.num_experts_per_tok
    x = torch.randn(t, config.hidden_size, generator=g) * 0.1
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return x.to(device), ids.to(device), w.to(device)


def _split_op(experts):
    return experts.impl["prefill"]


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
def test_split_against_the_reference(q4_k_m, triton_device, share):
    config, source = q4_k_m
    dev = triton_device.type
    ours = _experts(config, source, 1, dev, gpu_prefill_min_tokens=4, cpu_share=share)
    ref = _reference(config, source, 1)
    x, ids, w = _batch(config, 6, 0, triton_device)
    y = ours(x, ids, w)
    op = _split_op(ours)
    assert op.last["n_cpu"] == round(share * config.num_experts) and op.last["tokens"] == 6
    assert y.device.type == dev and y.shape == x.shape
    assert rel(y.cpu(), ref(x.cpu(), ids.cpu(), w.cpu())) < OP_TOL


def test_the_share_on_the_stream_equals_the_blocking_path(q4_k_m, triton_device):
    """`cpu_on_stream: true` enqueues the CPU's share on the CUDA stream (pinned staging, host functions) instead of
    waiting for it on the host: the same kernels on the same values, so the outputs are equal, and the share's time
    is read from the pool once the stream has run it (summary() waits for that)."""
    from ktrans.operators.experts_split import summary

    if triton_device.type != "cuda":
        pytest.skip("the stream path needs CUDA")
    config, source = q4_k_m
    x, ids, w = _batch(config, 37, 6, triton_device)
    outs = []
    for on_stream in (False, True):
        ours = _experts(config, source, 1, "cuda", gpu_prefill_min_tokens=4, cpu_share=0.5, cpu_on_stream=on_stream)
        op = _split_op(ours)
        op._stager.rates.cpu.clear()
        outs.append(ours(x, ids, w))
        s = summary(torch.nn.ModuleList([ours]))
        assert op.cpu_on_stream == on_stream and s["last_cpu_ms"][0] > 0 and op._stager.rates.cpu
    assert torch.equal(outs[0], outs[1])


def test_gpu_share_from_repacked_rows_equals_plain_rows(q4_k_m, triton_device):
    """All experts on the GPU: the blocks come from the CPU op's buffers, Q4_K_X16 (put back in row order on the
    device) or plain rows; the same bytes reach the same kernels, so the outputs are equal."""
    from ktrans import _cpu

    if not _cpu.reads_x16("auto"):
        pytest.skip("this CPU's kernels do not read the 16-row layout")
    config, source = q4_k_m
    outs = []
    for repack in (True, False):
        ours = _experts(config, source, 1, triton_device.type, gpu_prefill_min_tokens=1, cpu_share=0.0,
                        repack=repack)
        layouts = ours.impl["generate"].moe.layouts
        assert ("Q4_K_X16" in layouts) == repack, layouts
        outs.append(ours(*_batch(config, 5, 1, triton_device)))
    assert torch.equal(outs[0], outs[1])


def test_below_the_threshold_the_cpu_op_runs_alone(q4_k_m, triton_device):
    config, source = q4_k_m
    ours = _experts(config, source, 1, triton_device.type, gpu_prefill_min_tokens=8, cpu_share=0.0)
    x, ids, w = _batch(config, 7, 2, triton_device)
    y = ours(x, ids, w)
    assert _split_op(ours).last["n_cpu"] == config.num_experts
    cpu_op = ours.impl["generate"]
    assert torch.equal(y.cpu(), cpu_op(x.cpu(), ids.cpu(), w.cpu()).to(y.dtype))
    _split_op(ours).last = {}
    ours(*_batch(config, 8, 2, triton_device))  # exactly the threshold: split
    assert _split_op(ours).last["n_cpu"] == 0


def test_next_layer_uses_the_copy_this_layer_started(q4_k_m, triton_device):
    config, source = q4_k_m
    dev = triton_device.type
    layers = [_experts(config, source, n, dev, gpu_prefill_min_tokens=2, cpu_share=0.5) for n in (0, 1)]
    ops = [_split_op(e) for e in layers]
    assert ops[0]._stager is ops[1]._stager and ops[0]._stager.next_layer(0) is ops[1]
    x, ids, w = _batch(config, 6, 3, triton_device)
    layers[0](x, ids, w)
    assert 1 in ops[0]._stager.pending  # layer 1's share, copied while layer 0 ran
    started = ops[0]._stager.pending[1]
    y = layers[1](x, ids, w)
    assert ops[1].last["prefetched"] and 1 not in ops[0]._stager.pending
    assert started.first == ops[1].last["n_cpu"] == config.num_experts // 2
    alone = _experts(config, source, 1, dev, gpu_prefill_min_tokens=2, cpu_share=0.5)  # a copy made on the spot
    _split_op(alone)._stager.layers.clear()
    assert torch.equal(alone(x, ids, w), y) and not _split_op(alone).last["prefetched"]


def test_auto_split_balances_the_measured_rates():
    from ktrans.operators.experts_split import Rates, _bucket

    assert [_bucket(t) for t in (1, 2, 3, 512, 513)] == [1, 2, 4, 512, 1024]
    r = Rates()
    assert r.cpu_at(512) is None
    r.add_cpu(500, 3e-3)
    r.add_gpu(1e-3)
    assert r.cpu_at(512) == 3e-3 and r.cpu_at(1024) == pytest.approx(6e-3)  # nearest bucket, scaled
    r.add_cpu(512, 1e-3)
    assert r.cpu_at(512) == pytest.approx(2e-3)  # a running average
    r.add_gpu(3e-3)
    assert r.gpu == pytest.approx(2e-3)


def test_auto_split_from_rates(q4_k_m, triton_device):
    from ktrans.operators.experts_split import _PROBE_EVERY, summary

    config, source = q4_k_m
    ours = _experts(config, source, 1, triton_device.type, gpu_prefill_min_tokens=2)
    op = _split_op(ours)
    e = config.num_experts
    op._stager.rates.cpu.clear()  # the model's rates (shared by its layers; earlier tests measured some)
    op._stager.rates.gpu = None
    assert op.cpu_share is None and op.n_cpu(64, 4) == e // 2  # nothing measured yet: even
    op._stager.rates.cpu[64] = 3e-3
    op._stager.rates.gpu = 1e-3
    assert op.n_cpu(64, 4) == round(e * 1e-3 / 4e-3)  # n c = (E - n) g
    op._stager.rates.gpu = 1.0
    op._stager.calls = 0
    assert op.n_cpu(64, 4) == e  # a slow copy: all on the CPU
    # ... but one call in _PROBE_EVERY gives the GPU one expert, so a badly measured rate is measured again
    got = [op.n_cpu(64, 4) for _ in range(2 * _PROBE_EVERY - 1)]
    assert got.count(e - 1) == 2 and set(got) == {e, e - 1}
    op._stager.rates.cpu[64] = 1.0
    op._stager.rates.gpu = 1e-3
    got = [op.n_cpu(64, 4) for _ in range(_PROBE_EVERY)]
    assert got.count(1) == 1 and set(got) == {0, 1}  # and the CPU, where it measured slow
    x, ids, w = _batch(config, 6, 4, triton_device)
    op._stager.rates.cpu.clear()
    op._stager.rates.gpu = None
    ours(x, ids, w)
    summary(torch.nn.ModuleList([ours]))  # on CUDA the share's time is read once the stream has run it
    assert op._stager.rates.cpu  # the CPU share's time was measured


def test_bad_kwargs_name_the_field(q4_k_m):
    from ktrans.inject import parse_rules

    config, source = q4_k_m
    with pytest.raises(ValueError, match="cpu_share"):
        _experts(config, source, 1, "cpu", cpu_share=1.5)
    with pytest.raises(ValueError, match="gpu_prefill_min_tokens"):
        _experts(config, source, 1, "cpu", gpu_prefill_min_tokens=0)
    rule = """
- match: {name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}
  replace:
    class: KTransformersExpertsV2
    kwargs: {prefill_device: cuda, prefill_op: KExpertsSplit, generate_device: cpu, generate_op: KExpertsCPU,
             cpu_share: %s}
"""
    with pytest.raises(Exception, match="cpu_share.*int or float"):
        parse_rules(rule % '"half"', "r.yaml")
    with pytest.raises(Exception, match="cpu_share.*int or float"):
        parse_rules(rule % "true", "r.yaml")
    parse_rules(rule % "0.4", "r.yaml")


def test_needs_the_cpu_experts_as_generate_op(q4_k_m):
    from ktrans.model.qwen3_next import Qwen3NextExperts

    config, source = q4_k_m
    with torch.device("meta"):
        orig = Qwen3NextExperts(config)
    with _placeable("cpu"):
        experts = KTransformersExperts("model.layers.1.mlp.experts", orig, config, prefill_device="cpu",
                                       generate_device="cpu", prefill_op="KExpertsSplit", generate_op="KExpertsTorch")
        with pytest.raises(ValueError, match="generate_op: KExpertsCPU"):
            experts.build_ops(source)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_held_back_copies_are_waited_for(q4_k_m):
    """Four layers' worth of calls over two layer ops, three steps, with the copy stream spinning ~20 ms before
    each copy: the compute stream waits for it, and the planes of the two layers alternate without one overwriting
    the other; the outputs equal those of undelayed calls."""
    config, source = q4_k_m
    layers = [_experts(config, source, n, "cuda", gpu_prefill_min_tokens=2, cpu_share=0.25) for n in (0, 1)]
    st = _split_op(layers[0])._stager
    batches = [_batch(config, 40 + s, 10 + s, "cuda") for s in range(3)]

    def run():
        outs = []
        for x, ids, w in batches:
            h = x
            for layer in layers:
                h = layer(h, ids, w) + h  # each layer's input depends on the last: a real chain
            outs.append(h)
        return outs

    want = run()
    torch.cuda.synchronize()
    st.delay_cycles = 20_000_000
    try:
        got = run()
        torch.cuda.synchronize()
    finally:
        st.delay_cycles = 0
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert _split_op(layers[1]).last["prefetched"]


def test_summary_reports_the_split(q4_k_m, triton_device):
    from ktrans.operators.experts_split import summary

    config, source = q4_k_m
    layer = _experts(config, source, 1, triton_device.type, gpu_prefill_min_tokens=2, cpu_share=0.5)
    assert summary(torch.nn.ModuleList([torch.nn.Linear(2, 2)])) is None
    layer(*_batch(config, 6, 5, triton_device))
    s = summary(torch.nn.ModuleList([layer]))
    assert s["layers"] == 1 and s["last_n_cpu"] == [config.num_experts // 2] and s["last_tokens"] == 6
    assert s["last_cpu_ms"][0] > 0 and s["last_wall_ms"][0] > 0
    if triton_device.type == "cpu":  # the host waited for the share; on CUDA it only enqueued it
        assert s["last_wall_ms"][0] >= s["last_cpu_ms"][0] * 0.5
    assert s["pinned"] + s["not_pinned"] == (1 if triton_device.type == "cuda" else 0)


def test_a_runner_below_the_threshold_pins_nothing(q4_k_m, triton_device):
    config, source = q4_k_m
    op = _split_op(_experts(config, source, 1, triton_device.type, gpu_prefill_min_tokens=64))
    op.reserve(32)  # the runner's largest step: never split
    assert op._layout is None and op.pinned is None
    op.reserve(64)
    assert op._layout and (op.pinned is not None) == (triton_device.type == "cuda")


def test_split_asks_the_engine_for_long_steps(q4_k_m, triton_device):
    """Each step pays one pass over the experts, so a model with split prefill defaults to 4096-token steps (and to
    its threshold where that is higher); a model without one keeps 512."""
    from ktrans.engine.engine import DEFAULT_CHUNK_SIZE, default_chunk_size
    from ktrans.operators.experts_split import STEP_TOKENS

    config, source = q4_k_m
    ours = _experts(config, source, 1, triton_device.type, gpu_prefill_min_tokens=2)
    assert _split_op(ours).step_tokens == STEP_TOKENS == 4096 and default_chunk_size(ours) == STEP_TOKENS
    high = _experts(config, source, 1, triton_device.type, gpu_prefill_min_tokens=3 * STEP_TOKENS)
    assert default_chunk_size(high) == 3 * STEP_TOKENS
    assert default_chunk_size(_reference(config, source, 1)) == DEFAULT_CHUNK_SIZE == 512
