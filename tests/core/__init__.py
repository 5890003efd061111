"""Tests of core/: manifests and digests, serialization, packing."""
