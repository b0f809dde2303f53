"""Prompt sources that live in a module of their own (the built-in tasks and user files are in
data/prompts.py). Each is a config model with a `load(seed, train_answers)` that gives the split;
registration is one member of `ratchet.data.prompts.SourceConfig`.
"""
