"""Checkpoint + BuildConfig -> graph -> serialized engine per backend, with its memory plan.

Reads checkpoint directories (core/) and emits engine directories; knows no Hugging Face names.
"""
