"""Prompt sources, one module each (addition, chain, file, reasoning_gym). Each is a config model
(data/sources/base.py: PoolSource) with a `load(seed, train_answers)` that gives the checked split,
and what it measures of an evaluation beyond accuracy (`eval_metrics`); registration is one member
of `ratchet.data.prompts.SourceConfig`.
"""
