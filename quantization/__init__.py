"""Post-training quantization: schemes (weight-only RTN, and later calibrated AWQ, SmoothQuant, FP8, KV cache),
their scales and reference dequantization. Knows canonical tensor names, not Hugging Face ones.
"""
