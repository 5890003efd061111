"""The unquantized reference of a quantized build: the same model, limits and plugins with float weights and a float
KV cache, tp 1, on onnxruntime (for --dtype gguf: the kept blocks, exact, with float32 activations: reference_quant).
Built once, next to the engine being built, the first time something needs it, and deleted with the build whatever
happens:

    sample(...)            calibration text when no --calib-data is given: sequences the reference samples itself
                           (temperature 1, seeded) through its paged KV cache, SAMPLE_BATCH at a time
                           (runtime/perplexity.sample_tokens); faster than the torch twin (bench/NOTES.md entry 14)
    accuracy_report(...)   held-out text sampled by the reference (and its answers to chat prompts), scored by both

A build that needs neither (weight-only with no report, int4 kept on the checkpoint's blocks) never builds it.
"""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

from engine.core.artifacts import save_sealed
from engine.core.model_config import Mapping, QuantConfig
from engine.core.engine_format import BuildConfig, EngineConfig, PluginConfig
from engine.core.errors import EngineError
from engine.quantization.modes import GGUF
from engine.quantization.accuracy import AccuracyOptions, accuracy_report, chat_windows, held_out_windows
from engine.runtime.engine_dir import backend_version

from .memory import memory_plan
from .rank_job import RankJob, build_rank

# sequences sampled together. SmolLM2 fp32, 2 threads, 128 tokens each: 136 / 156 / 158 tok/s at 16 / 32 / 64
# (bench/NOTES.md entry 14); 32 x 512 tokens take a 0.75 GB KV pool
SAMPLE_BATCH = 32


def reference_quant(quant: QuantConfig) -> QuantConfig:
    """The reference's quantization: none (float32 weights), or for --dtype gguf the kept blocks with float32
    activations, the same weights at the gguf engine's size instead of 4 bytes a weight (bench/NOTES.md 53)."""
    if quant.mode != GGUF:
        return QuantConfig()
    return QuantConfig(mode=GGUF, formats=quant.formats, accuracy_level=quant.accuracy_level, float_activations=True)


class ReferenceEngine:
    def __init__(self, ckpt_dir: Path, config: EngineConfig, parent: Path):
        """`config`: the engine being built (its quantization is ignored); the reference goes into `parent`."""
        self._ckpt_dir, self._config, self._parent = Path(ckpt_dir), config, Path(parent)
        self._dir: Path | None = None

    def __enter__(self) -> ReferenceEngine:
        return self

    def __exit__(self, *exc) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def path(self) -> Path:
        """The reference engine's directory, built on the first call."""
        if self._dir is None:
            config = self._config
            b = config.build
            on_ort = b.backend == "onnxruntime"  # a TensorRT build's graph flavour is not for onnxruntime
            build = dataclasses.replace(b, kv_cache_dtype="float32", tp_size=1, moe_ep_size=1, backend="onnxruntime",
                                        opt_level=b.opt_level if on_ort else BuildConfig().opt_level,
                                        max_batch_size=max(b.max_batch_size, SAMPLE_BATCH),
                                        max_num_tokens=max(b.max_num_tokens, SAMPLE_BATCH))
            plugins = config.plugins if on_ort else PluginConfig()
            quant = reference_quant(config.quantization)
            reference = dataclasses.replace(config, build=build, plugins=plugins, mapping=Mapping(),
                                            quantization=quant,
                                            memory=memory_plan(config.model, build, quant, plugins),
                                            precision={}, backend_version=backend_version("onnxruntime"),
                                            backend_device={})
            self._dir = Path(tempfile.mkdtemp(prefix=".reference-", dir=self._parent))
            build_rank(RankJob(self._ckpt_dir, self._dir, 0, build, plugins, quant))
            save_sealed(self._dir, reference)
        return self._dir

    def sample(self, sequences: int, length: int, seed: int, start_token: int) -> list[list[int]]:
        """`sequences` token sequences of `length` tokens (each `start_token` and what the reference samples after
        it), SAMPLE_BATCH at a time, the k-th batch seeded seed + k."""
        from engine.runtime.perplexity import sample_tokens

        seqs: list[list[int]] = []
        for k, first in enumerate(range(0, sequences, SAMPLE_BATCH)):
            seqs += sample_tokens(self.path(), sequences=min(SAMPLE_BATCH, sequences - first), length=length,
                                  seed=seed + k, start_token=start_token)
        return seqs

    def accuracy_report(self, engine_dir: Path, opts: AccuracyOptions, start_token: int | None) -> dict:
        """Perplexity of the reference and of the quantized engine at `engine_dir` on the same held-out text."""
        if self._config.mapping.world_size > 1:
            if opts.max_ppl_increase is not None:
                raise EngineError("--max-ppl-increase needs a tp 1 build: tensor-parallel engines cannot be scored "
                                  "here")
            return {"skipped": "tensor-parallel engines cannot be scored on this machine"}
        held_out = held_out_windows(opts, self.path(), self._ckpt_dir, start_token)
        chat = chat_windows(self.path(), self._ckpt_dir, self._config.generation.eos_token_ids)
        return accuracy_report(self.path(), engine_dir, held_out, chat)
