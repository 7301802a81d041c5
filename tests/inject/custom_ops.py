"""A user-defined operator living outside ktrans, resolved by its dotted import path in a rule."""
from __future__ import annotations

import torch

from ktrans.operators.base import move
from ktrans.operators.linear import KTransformersLinear


class KScaledLinear(KTransformersLinear):
    """KTransformersLinear times a factor given in the rule's kwargs (an op-specific kwarg)."""

    EXTRA_KWARGS = {"scale": float}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phase, dev = self.phase_device()
        return self.leave(self.op_for(phase)(move(x, dev)) * self.options.get("scale", 1.0), phase)
