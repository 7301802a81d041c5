"""Injection: YAML rules decide, module by module, which operator runs it on which device (see doc/rules.md)."""
from ktrans.inject.injector import (Injection, Placed, build_injected_model, inject, load_injected_model,
                                    load_weights, pool_devices)
from ktrans.inject.rules import Rule, RuleError, RuleSet, check_devices, load_rules, parse_rules

__all__ = ["Injection", "Placed", "build_injected_model", "inject", "load_injected_model", "load_weights",
           "pool_devices", "Rule", "RuleError", "RuleSet", "check_devices", "load_rules", "parse_rules"]
