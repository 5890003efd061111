"""Shared ground of every stage: the project error type, the artifact schemas (model config, mapping,
quantization), atomic artifact directories and tensor-parallel sharding of canonical tensors.

Knows nothing of Hugging Face names, ONNX or the runtime; everything else may import it.
"""

# This installation's version, recorded in every engine and checked when one is loaded. Kept equal to pyproject's
# [project] version by tests/runtime/test_run_imports.py; read from here because importlib.metadata costs ~35 ms of
# cold start.
VERSION = "0.1.0"
