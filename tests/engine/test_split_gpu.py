"""The 2-GPU rules on two real GPUs (skipped unless torch.cuda.device_count() >= 2): the small model split by layer
range over cuda:0 and cuda:1 gives one GPU's logits, teacher-forced through chunked prefill, mixed steps and 64
decode steps of the engine's runner, for both shipped 2-GPU files (experts on the CPU; everything on the GPUs);
its pools and index buffers sit on their layers' GPUs; an engine on it generates what one GPU's does, decoding
eagerly with the reason logged.

    pytest -q -m gpu tests/engine/test_split_gpu.py
"""
from __future__ import annotations

import logging

import pytest
import torch

from ktrans.config import RULES_DIR, ModelConfig
from ktrans.engine.engine import Engine, EngineConfig, batch_device, collect, make_pools
from ktrans.engine.runner import ModelRunner
from ktrans.engine.sampler import SamplingParams
from ktrans.inject import layer_devices
from ktrans.operators.experts import EXPERT_OPS
from ktrans.runtime.batch import SeqChunk

from ..inject.helpers import injected, rules
from ..model.helpers import default_tokenizer, make_checkpoint
from .test_split_devices import GPU0, GPU1, run_steps, two_gpu_text

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]
TOL = 2e-5  # fp32 with TF32 off, relative to the largest logit: one GPU and two run the same kernels
PAIRS = [("Qwen3Next-serve-2gpu.yaml", "Qwen3Next-serve.yaml"), ("Qwen3Next-2gpu.yaml", "Qwen3Next-gpu.yaml")]


def _ops_here(text: str) -> str:
    if not EXPERT_OPS.built("KExpertsCPU"):  # the C++ experts are another issue's; the placement is tested here
        text = text.replace('"KExpertsCPU"', '"KExpertsTorch"')
    return text


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return make_checkpoint(tmp_path_factory.mktemp("split-gpu"), "small", seed=5)


def _pair(ckpt, split_file: str, one_file: str):
    """(the model under the 2-GPU file cut to the small model's layers, the model under the one-GPU file)."""
    n = ModelConfig.from_json(ckpt / "config.json").num_hidden_layers
    split, _ = injected(ckpt, rules(_ops_here(two_gpu_text(n, on_cpu=False, name=split_file))))
    one, _ = injected(ckpt, rules(_ops_here((RULES_DIR / one_file).read_text())))
    return split, one


@pytest.mark.parametrize("split_file, one_file", PAIRS)
def test_two_gpus_give_one_gpus_logits(ckpt, split_file, one_file):
    split, one = _pair(ckpt, split_file, one_file)
    n = split.config.num_hidden_layers
    assert layer_devices(split) == {i: GPU0 if i < n // 2 else GPU1 for i in range(n)}
    # 64 decode steps: pages for 19 + 65 tokens per sequence
    kv, states = make_pools(split, 3 * 22, 4, 3)
    assert [p.device for p in kv.parts] == [GPU0, GPU1] and [p.device for p in states.parts] == [GPU0, GPU1]
    kv1, states1 = make_pools(one, 3 * 22, 4, 3)
    assert len(kv1.parts) == 1 and kv1.parts[0].device == GPU0
    got = run_steps(split, kv, states, n_decode=64, device=batch_device(split))
    want = run_steps(one, kv1, states1, n_decode=64, device=batch_device(one))
    assert len(got) == 67
    for a, b in zip(want, got):
        scale = a.abs().max()
        assert (a - b).abs().max() <= TOL * scale
        top2 = a.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > TOL * scale  # the same argmax wherever the reference's margin is clear
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_runner_keeps_index_buffers_on_both_gpus_and_decodes_eagerly(ckpt, caplog):
    split, _ = _pair(ckpt, *PAIRS[0])
    kv, states = make_pools(split, 24, 4, 3)
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(split, kv, states, 4, 32, 8, device=GPU0, cuda_graph=True)
    assert runner.graphs is None and "spans 2 GPUs" in caplog.text
    batch = runner.prepare([SeqChunk([1, 2, 3], 0, 0, [0])])
    other = batch.on(GPU1)
    assert other.input_ids.device == GPU1 and other.input_ids.data_ptr() == runner.others[GPU1].data_ptr()
    assert torch.equal(other.slot_mapping.cpu(), batch.slot_mapping.cpu())


def test_engine_on_two_gpus_generates_one_gpus_tokens(ckpt):
    split, one = _pair(ckpt, *PAIRS[0])
    tok = default_tokenizer()
    prompts = [[(7 * i + 3) % 500 for i in range(n)] for n in (5, 23, 40)]
    outs = []
    for model in (split, one):
        # graphs off for one GPU too: its padded graph buckets agree with eager steps only within the tolerance
        engine = Engine(model, tok, EngineConfig(max_batch_size=3, chunk_size=16, cache_lens=512, page_size=16,
                                                 use_cuda_graph=model is split))
        if model is split:  # asked for graphs, it decodes eagerly (the runner test checks the logged reason)
            assert engine.runner.graphs is None and engine.device == GPU0
            assert [p.device for p in engine.kv.parts] == [GPU0, GPU1]
        streams = [engine.submit(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) for p in prompts]
        while engine.poll():
            pass
        outs.append([collect(s).token_ids for s in streams])
    assert outs[0] == outs[1] and all(len(o) == 24 for o in outs[0])
