"""Routing statistics: how often each MoE layer's router picked each expert, and the hottest experts read back.

`--routing_stats_out PATH` (ktrans serve, ktrans bench e2e) records them: each MoE block adds its step's top-k ids
to a per-layer count on the ids' device (a scatter-add, no host sync), in eager forward steps only: every prefill
token, and decode steps that run eagerly (a replayed CUDA graph runs no Python; its routing follows the same
distribution as the prompts'). Pad rows of a padded decode batch are not counted, nor are decode steps whose
routing runs inside the CPU experts' stage-in launch (KTRANS_ROUTE_STAGE=1). The file is JSON:

    {"format": "ktrans-routing-stats/1", "num_experts": 512, "layers": {"0": [count per expert, ...], ...},
     "tokens": {"0": tokens counted, ...}}

`gpu_experts_from: PATH` on KExpertsCPU (`--gpu_experts_from` with `--num_gpu_experts N`) then keeps each layer's N
most-routed experts resident on the GPU instead of experts 0..N-1: with a real router's skew those take a larger
share of the routed pairs than N / E (SGLang + kt-kernel and KTransformers place GPU experts by activation
frequency the same way).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

FORMAT = "ktrans-routing-stats/1"


class RoutingStats:
    """The recorder (one per process: ROUTING). Off until `start()`."""

    def __init__(self) -> None:
        self.on = False
        self.num_experts: int | None = None
        self._counts: dict[tuple[int, str], torch.Tensor] = {}  # (layer, device): a layer's phases may differ
        self.tokens: dict[int, int] = {}

    def start(self) -> None:
        self.on, self._counts, self.tokens, self.num_experts = True, {}, {}, None

    def stop(self) -> None:
        self.on = False

    @property
    def counts(self) -> dict[int, torch.Tensor]:
        """Each layer's counts on the host, summed over the devices it was recorded on (syncs)."""
        out: dict[int, torch.Tensor] = {}
        for (layer, _), c in self._counts.items():
            out[layer] = out[layer] + c.cpu() if layer in out else c.cpu()
        return out

    def record(self, layer: int, ids: torch.Tensor, num_experts: int, live: int | None = None) -> None:
        """Add ids [T, k] (the first `live` rows: a padded batch's live ones) to layer's counts."""
        if not self.on or (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        if self.num_experts not in (None, num_experts):
            raise ValueError(f"routing statistics: layer {layer} has {num_experts} experts, an earlier one "
                             f"{self.num_experts}")
        self.num_experts = num_experts
        ids = ids if live is None else ids[:live]
        key = (layer, str(ids.device))
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
        flat = ids.reshape(-1).to(torch.int64)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        self.tokens[layer] = self.tokens.get(layer, 0) + ids.shape[0]

    def to_json(self) -> dict:
        return {"format": FORMAT, "num_experts": self.num_experts,
                "layers": {str(k): v.tolist() for k, v in sorted(self.counts.items())},
                "tokens": {str(k): v for k, v in sorted(self.tokens.items())}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))


ROUTING = RoutingStats()


@functools.lru_cache(maxsize=4)
def _read(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"gpu_experts_from: cannot read routing statistics from {path}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("layers"), dict):
        raise ValueError(f"gpu_experts_from: {path} is not a routing statistics file (format {FORMAT!r}, written "
                         f"by --routing_stats_out)")
    return data


def hot_experts(path: str | Path, layer: int, n: int, num_experts: int) -> list[int]:
    """Layer's n most-routed experts in `path` (ties: the lower id first), in that order."""
    data = _read(str(path))
    if data.get("num_experts") != num_experts:
        raise ValueError(f"gpu_experts_from: {path} counts {data.get('num_experts')} experts a layer, the model "
                         f"has {num_experts}")
    counts = data["layers"].get(str(layer))
    if counts is None:
        raise ValueError(f"gpu_experts_from: {path} has no counts for layer {layer} (it has "
                         f"{len(data['layers'])} layers)")
    if len(counts) != num_experts:
        raise ValueError(f"gpu_experts_from: {path}: layer {layer} has {len(counts)} counts, not {num_experts}")
    return sorted(range(num_experts), key=lambda e: (-counts[e], e))[:n]
