"""Tiny engines for this folder (tests/builder/engines.py), and the TensorRT flavour of their graphs.

The TensorRT flavour is what builder/tensorrt_backend.py hands TensorRT's parser: the graph of build_graph with
`tensorrt_plugins(...)`, not optimized by ONNX Runtime. Built here with backend onnxruntime and opt_level
"disable", it is that graph saved as rank0.onnx, so onnxruntime can check it against transformers.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.builder.build import build_engine
from engine.builder.tensorrt_backend import tensorrt_plugins
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD, TinyEngines, slug

TRT_FLAVOUR_BUILD = dataclasses.replace(TEST_BUILD, opt_level="disable")


class TrtFlavourEngines(TinyEngines):
    def trt_flavour(self, key: str, tp_size: int = 1) -> Path:
        """tp > 1: each rank's graph cut at its all-reduces into segments (builder/segments.py), which onnxruntime's
        tensor-parallel runtime runs."""
        d = self.root / slug(key) / f"engine_trt_flavour_tp{tp_size}"
        if not d.exists():
            build = dataclasses.replace(TRT_FLAVOUR_BUILD, tp_size=tp_size)
            build_engine(self.checkpoint(key), d, build, tensorrt_plugins(ALL_PLUGINS))
        return d


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TrtFlavourEngines:
    return TrtFlavourEngines(tmp_path_factory.mktemp("tiny_trt_engines"))
