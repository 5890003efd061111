"""Fused ops. Each op has a plain reference lowering in standard ONNX ops and a backend lowering that uses the
backend's fast kernel; `plugin=True` picks the backend lowering. Every lowering is tested against the reference.
"""
