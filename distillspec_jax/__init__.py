"""distillspec-jax: draft models for speculative decoding, trained by distillation (DistillSpec, AdaSPEC).

Binaries at this level (python -m distillspec_jax.<name>): main, train, eval, convert.
Layers, lowest first: core, models, decoding, data, distill, training, interop, evaluation, studies.
"""
