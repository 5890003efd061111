"""Post-training quantization: the modes `engine build --dtype` accepts, their schemes and scales.

Weight-only RTN (int8_wo, int4_wo): weight_only.py. Calibrated with NVIDIA ModelOpt at build (int8_sq, fp8, int4_awq):
modelopt_calibration.py runs mtq.quantize on torch_model.py's canonical model and calibrated_weights.py holds the
scales; w4a8_awq and nvfp4 are named in modes.py and refused. The int8 KV cache's scales (with any mode): kv_cache.py.
Lowerings to graph ops live in plugins/linear.py, plugins/calibrated_linear.py and plugins/attention.py. Knows canonical
tensor names, not Hugging Face ones.
"""
