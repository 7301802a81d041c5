"""Injection: YAML rules decide, module by module, which operator runs it on which device (see doc/rules.md).
`load_model` is the one way a model is loaded: the plain model is the default rules' injection."""
from ktrans.inject.injector import (Injection, Placed, build_injected_model, compute_devices, inject, layer_devices,
                                    load_weights, pool_devices)
from ktrans.inject.load import default_rules, load_model
from ktrans.inject.rules import Rule, RuleError, RuleSet, check_devices, load_rules, parse_rules

__all__ = ["Injection", "Placed", "build_injected_model", "default_rules", "inject", "load_model", "load_weights",
           "compute_devices", "layer_devices", "pool_devices", "Rule", "RuleError", "RuleSet", "check_devices", "load_rules", "parse_rules"]
