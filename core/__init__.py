"""Shared ground of every stage: the project error type, the artifact schemas (model config, mapping,
quantization), atomic artifact directories and tensor-parallel sharding of canonical tensors.

Knows nothing of Hugging Face names, ONNX or the runtime; everything else may import it.
"""
