"""Everything that touches weights: the default model, sampler backends, trainers."""
