"""Write a copy of a rule file whose operators use the named ops (an A/B of kernels under the same placement).

    python3 scripts/rules_with_ops.py IN.yaml OUT.yaml triton      # the Triton layer ops (issue 15)
    python3 scripts/rules_with_ops.py IN.yaml OUT.yaml triton+quant  # and the quantized GPU linears (issue 16)

Every rule whose replacement class ends with an operator name below gets `generate_op` / `prefill_op` set to that
op, where the rule places the operator on a GPU in that phase; other rules are copied as they are. The result is
validated by the caller (`ktrans rules validate OUT.yaml`), not here.
"""
from __future__ import annotations

import sys

import yaml

SETS = {
    "triton": {
        "KQwen3NextGatedDeltaNet": "KGatedDeltaNetTriton",
        "KQwen3NextAttention": "KAttentionTriton",
        "KQwen3NextRMSNorm": "KRMSNormTriton",
        "KQwen3MoeRotaryEmbedding": "KRoPETriton",
        "KQwen3NextRotaryEmbedding": "KRoPETriton",
        "KQwen3NextSparseMoeBlockV2": "KRouterTriton",
        "KQwen3NextSparseMoeBlock": "KRouterTriton",
    },
    "quant": {"KTransformersLinear": "KLinearMarlin"},
}


def rewrite(rules: list[dict], ops: dict[str, str]) -> int:
    changed = 0
    for rule in rules:
        rep = rule.get("replace") or {}
        name = str(rep.get("class", "")).rsplit(".", 1)[-1]
        if name not in ops:
            continue
        kw = rep.setdefault("kwargs", {}) or {}
        rep["kwargs"] = kw
        for phase in ("generate", "prefill"):
            if str(kw.get(f"{phase}_device", "")).startswith("cuda"):
                kw[f"{phase}_op"] = ops[name]
                changed += 1
    return changed


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst, which = argv[1:]
    ops: dict[str, str] = {}
    for part in which.split("+"):
        if part not in SETS:
            print(f"unknown op set {part!r}; known: {', '.join(SETS)}", file=sys.stderr)
            return 2
        ops.update(SETS[part])
    with open(src) as f:
        rules = yaml.safe_load(f)
    n = rewrite(rules, ops)
    with open(dst, "w") as f:
        f.write(f"# {src} with the {which} ops (scripts/rules_with_ops.py)\n")
        yaml.safe_dump(rules, f, sort_keys=False)
    print(f"{dst}: {n} phase ops set")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
