"""Reference depthwise causal conv1d (the short conv in front of a Gated DeltaNet) in plain torch.

Tokens are rows: x is [L, C] for one sequence or [B, C] for one decode token of B sequences. The carried state
holds the previous K-1 inputs per channel, oldest first; that is all a width-K causal conv needs to continue a
sequence, so prefill chunks and decode steps chain exactly. (transformers keeps K inputs in its cache; the oldest
one is never read, so its state[..., 1:] is ours.) The conv is computed in float32, which equals transformers
for float32 weights and is the accurate side of it for bf16 ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r} (expected 'silu' or None)")


def causal_conv1d(x, weight, conv_state=None, activation="silu"):
    """One sequence. x [L, C]; weight [C, K]; conv_state [C, K-1] or None (zeros).

    Returns (y [L, C] in x.dtype, new_state [C, K-1]: the last K-1 inputs of [state; x], in the state's dtype).
    """
    length, channels = x.shape
    width = weight.shape[-1]
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    if conv_state is None:
        conv_state = x.new_zeros(channels, width - 1)
    if conv_state.shape != (channels, width - 1):
        raise ValueError(f"conv_state has shape {tuple(conv_state.shape)}, expected {(channels, width - 1)}")
    history = torch.cat([conv_state.float(), x.t().float()], dim=-1)  # [C, K-1+L]
    # No padding: the K-1 state columns are the left context, so the output has exactly L columns.
    y = F.conv1d(history[None], weight.float()[:, None, :], groups=channels)[0]
    y = _activate(y, activation).t().to(x.dtype)
    # Slice by start index: history[:, -0:] would keep everything when K == 1.
    new_state = history[:, history.shape[-1] - (width - 1):].to(state_dtype).contiguous()
    return y, new_state


def causal_conv1d_update(x, weight, conv_state, activation="silu"):
    """One token for each of B sequences. x [B, C]; weight [C, K]; conv_state [B, C, K-1] updated in place.

    Returns y [B, C] in x.dtype.
    """
    window = torch.cat([conv_state.float(), x[..., None].float()], dim=-1)  # [B, C, K]
    y = (window * weight.float()).sum(dim=-1)
    conv_state.copy_(window[..., 1:])
    return _activate(y, activation).to(x.dtype)
