"""Routing statistics (ktrans.operators.routing_stats): the recorder, its file, and what `ktrans serve` and `ktrans
bench e2e` write with --routing_stats_out and read with --gpu_experts_from."""
from __future__ import annotations

import json

import pytest
import torch

from ktrans.cli import main
from ktrans.config import RULES_DIR
from ktrans.engine.engine import Engine
from ktrans.engine.sampler import SamplingParams
from ktrans.operators.routing_stats import FORMAT, ROUTING, RoutingStats, _read, hot_experts


@pytest.fixture
def recording():
    ROUTING.start()
    yield ROUTING
    ROUTING.on = False
    _read.cache_clear()


def test_recorder_counts_live_rows_and_reads_back_the_hottest(tmp_path):
    rs = RoutingStats()
    ids = torch.tensor([[3, 1], [3, 0], [7, 7]])
    rs.record(0, ids, 8)
    assert rs.counts == {}  # off until started
    rs.start()
    rs.record(0, ids, 8, live=2)  # a padded batch: the last row is a pad row
    rs.record(0, torch.tensor([[1, 5]]), 8)
    rs.record(2, ids, 8)
    assert rs.counts[0].tolist() == [1, 2, 0, 2, 0, 1, 0, 0] and rs.tokens == {0: 3, 2: 3}
    with pytest.raises(ValueError, match="layer 1 has 4 experts"):
        rs.record(1, ids, 4)
    path = tmp_path / "r.json"
    rs.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["num_experts"] == 8 and set(data["layers"]) == {"0", "2"}
    assert hot_experts(path, 0, 3, 8) == [1, 3, 0]  # ties: the lower id first
    assert hot_experts(path, 2, 2, 8) == [3, 7]  # a repeated pair counts twice
    with pytest.raises(ValueError, match="no counts for layer 1"):
        hot_experts(path, 1, 2, 8)
    with pytest.raises(ValueError, match="counts 8 experts a layer, the model has 16"):
        hot_experts(path, 0, 2, 16)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": {}}))
    with pytest.raises(ValueError, match="not a routing statistics file"):
        hot_experts(bad, 0, 1, 8)
    with pytest.raises(ValueError, match="cannot read routing statistics"):
        hot_experts(tmp_path / "missing.json", 0, 1, 8)
    _read.cache_clear()


def test_every_token_of_a_generation_is_counted(tiny, recording, tmp_path):
    """The embedded default under the CPU rules: prefill through the module forward, decode through the flat CPU
    step; every MoE layer counts k experts for each prompt token and each decoded token fed back."""
    model, tok = tiny
    prompt, n = list(range(5, 26)), 6
    Engine.for_one_request(model, tok, len(prompt) + n).generate(prompt, SamplingParams(temperature=0.0,
                                                                                        max_tokens=n))
    k = model.config.num_experts_per_tok
    fed = len(prompt) + n - 1  # the last token is sampled, never fed
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert sorted(recording.counts) == moe_layers
    assert all(int(c.sum()) == fed * k for c in recording.counts.values())
    assert set(recording.tokens.values()) == {fed}


def test_stats_out_must_be_writable_before_serving(tmp_path):
    from ktrans.api.server import check_routing_stats_out

    check_routing_stats_out(str(tmp_path / "r.json"))
    with pytest.raises(ValueError, match="--routing_stats_out .*cannot write there"):
        check_routing_stats_out(str(tmp_path / "no" / "r.json"))
    with pytest.raises(ValueError, match="--routing_stats_out"):
        check_routing_stats_out(str(tmp_path))


def test_flags_name_each_other(tmp_path, capsys):
    serve = str(RULES_DIR / "Qwen3Next-serve.yaml")
    stats = tmp_path / "r.json"
    stats.write_text("{}")
    assert main(["rules", "show", "--optimize_config_path", serve, "--gpu_experts_from", str(stats)]) == 2
    assert "--gpu_experts_from needs --num_gpu_experts N > 0" in capsys.readouterr().err
    assert main(["rules", "show", "--optimize_config_path", serve, "--num_gpu_experts", "8", "--gpu_experts_from",
                 str(tmp_path / "none.json")]) == 2
    assert "--gpu_experts_from: no such file" in capsys.readouterr().err
