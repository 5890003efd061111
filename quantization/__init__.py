"""Post-training quantization: the modes `engine build --dtype` accepts, their schemes and scales.

Weight-only RTN (int8_wo, int4_wo) is implemented (weight_only.py); the calibrated ModelOpt modes are named in
modes.py and refused until they are. Lowerings to graph ops live in plugins/linear.py. Knows canonical tensor
names, not Hugging Face ones.
"""
