"""Injectable operators. Importing this package registers every operator (OPERATORS) and op (the *_OPS)."""
from ktrans.operators.base import OPERATORS, BaseOperator, Op, OpNotBuiltError, OpRegistry, ParamSpec, register_operator
from ktrans.operators import attention, embedding, experts, gdn, linear, moe, norm, rope  # noqa: F401  (registration)
from ktrans.operators.experts import EXPERT_OPS, ExpertsOp
from ktrans.operators.linear import LINEAR_OPS

__all__ = ["OPERATORS", "BaseOperator", "Op", "OpNotBuiltError", "OpRegistry", "ParamSpec", "register_operator",
           "EXPERT_OPS", "ExpertsOp", "LINEAR_OPS"]
