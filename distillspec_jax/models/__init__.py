"""Networks: TransformerConfig and presets, T5 1.1 layers, the encoder-decoder and decoder-only LM, the per-row decoding cache, and Model (init, logits, extend, prefill)."""
