"""Calibration of int8_sq, fp8 and int4_awq with NVIDIA ModelOpt, at build time, from the float checkpoint.

    checkpoint tensors (tp 1) ──▶ CanonicalLM (torch_model.py; nn.Linear per packed projection)
    calibration tokens: --calib-data FILE (.txt: one text cut into --calib-max-seq-len windows; .jsonl: one
        {"text": ...} or string per line, each truncated), or sequences the model samples itself (seeded,
        temperature 1), so a build never needs a download; --calib-size sequences at most
    mtq.quantize(model, ModelOpt's config, forward loop over the tokens)      fake-quant on CPU
        int8_sq   INT8_SMOOTHQUANT_CFG with alpha 0.5: SmoothQuant input scales, per-channel int8 weights
        fp8       FP8_DEFAULT_CFG: per-tensor e4m3 weights and static per-tensor e4m3 activations
        int4_awq  INT4_AWQ_CFG with its block size set to the build's group size: AWQ-lite input scales,
                  int4 weights per group of input features; layers that keep the checkpoint's 4-bit blocks
                  (QuantConfig.source_grid) are disabled, so only a quantized lm_head is calibrated, or nothing
    ──▶ per projection: the smoothed / AWQ-scaled weight quantized with ModelOpt's amax (calibrated_weights.py)
    tp > 1: calibrated once, as here, on the whole model; each rank job takes its slice of the result
        (calibrated.shard_calibrated: scales split with the weights they belong to, as TensorRT-LLM splits them)

Why at build and not a separate `engine quantize` step: the checkpoint is the only input the build needs, the
calibrated scales can never drift from the weights they belong to, and every registered family calibrates
through one canonical torch model instead of a transformers model per family. The scales are stored in the engine
next to their weights (calibrated_weights.py names), and the build records the calibration data in config.json.

Activations of int8_sq are quantized dynamically at run time, one symmetric scale per token
(plugins/calibrated_linear.py); ModelOpt's static per-tensor amax is not used, so only its smoothing and weight scales
carry over. Embeddings and lm_head stay
float32 (ModelOpt's default configs disable "*lm_head*") unless quantize_lm_head.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from engine.core.errors import EngineError
from engine.core.model_config import ModelConfig, QuantConfig

from .calibrated_weights import CALIBRATED, CalibratedWeight, quantize_weight

CONFIGS = {"int8_sq": "INT8_SMOOTHQUANT_CFG", "fp8": "FP8_DEFAULT_CFG", "int4_awq": "INT4_AWQ_CFG"}
INSTALL = "pip install 'engine[quantization]' (it installs nvidia-modelopt[hf])"
# SmoothQuant's migration strength: TensorRT-LLM's and the paper's default. ModelOpt's config uses 1.0 (all of the
# activation range moved into the weights); measured on the tiny test models (fake-quant logits vs float32):
# alpha 1.0 11% RMS error, 0.8 7%, 0.5 2.8%.
SMOOTHQUANT_ALPHA = 0.5
SAMPLE_SEED_OFFSET = 7919  # calibration text is drawn with a seed apart from the accuracy report's held-out text
# (sequences, length, seed, start_token) -> sampled token sequences: builder/reference.ReferenceEngine.sample
Sampler = Callable[[int, int, int, int], list[list[int]]]


@dataclass(frozen=True)
class CalibrationOptions:
    data: Path | None = None   # .txt or .jsonl; None: sampled by the model itself
    size: int = 512            # sequences
    max_seq_len: int = 512     # tokens per sequence
    seed: int = 0
    batch_size: int = 8        # sequences per calibration forward
    cache: Path | None = None  # --calib-cache: reuse or store the result there (calibration_cache.py)

    def __post_init__(self):
        if self.size < 1:
            raise EngineError(f"--calib-size {self.size} must be at least 1", usage=True)
        if self.max_seq_len < 2:
            raise EngineError(f"--calib-max-seq-len {self.max_seq_len} must be at least 2", usage=True)


def import_modelopt(mode: str):
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as e:
        raise EngineError(f"--dtype {mode} is calibrated with NVIDIA ModelOpt, which is not installed ({e}); "
                          f"{INSTALL}") from None
    return mtq


# ---- calibration tokens -------------------------------------------------------------------------------------

def read_calibration_tokens(path: Path, tokenizer_dir: Path, opts: CalibrationOptions) -> list[list[int]]:
    """Token sequences of a .txt or .jsonl file (see the module docstring); refuses empty or unreadable files."""
    from engine.runtime.tokenizer import Tokenizer
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EngineError(f"cannot read calibration data {path}: {e}; pass a UTF-8 .txt or .jsonl file") from None
    tok = Tokenizer(tokenizer_dir)
    n = opts.max_seq_len
    if str(path).endswith(".jsonl"):
        seqs = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise EngineError(f"calibration data {path} line {lineno} is not JSON ({e.msg}); each line of a "
                                  ".jsonl file must be a string or an object with a \"text\" field") from None
            value = item.get("text") if isinstance(item, dict) else item
            if not isinstance(value, str):
                raise EngineError(f"calibration data {path} line {lineno} has no \"text\" string; each line of a "
                                  ".jsonl file must be a string or an object with a \"text\" field")
            ids = tok.encode(value)[:n]
            if len(ids) >= 2:
                seqs.append(ids)
            if len(seqs) == opts.size:
                break
    else:
        ids = tok.encode(text)
        seqs = [ids[i:i + n] for i in range(0, len(ids), n)]
        seqs = [s for s in seqs if len(s) >= 2][:opts.size]
    if not seqs:
        raise EngineError(f"calibration data {path} holds no text (no sequence of 2 or more tokens); pass a file "
                          "with text, or leave out --calib-data to calibrate on text the model samples itself")
    return seqs


def calibration_tokens(opts: CalibrationOptions, tokenizer_dir: Path, start_token: int, max_positions: int,
                       sample: Sampler) -> tuple[list[list[int]], str]:
    """The calibration sequences and where they came from: --calib-data, or text `sample` draws (the build's float
    reference engine, builder/reference.py: temperature 1, seeded)."""
    if opts.data is not None:
        return read_calibration_tokens(opts.data, tokenizer_dir, opts), f"file {opts.data}"
    seed = opts.seed + SAMPLE_SEED_OFFSET
    seqs = sample(opts.size, min(opts.max_seq_len, max_positions), seed, start_token)
    return seqs, f"sampled from the float reference engine (seed {seed}, temperature 1)"


# ---- ModelOpt -------------------------------------------------------------------------------------------------

def modelopt_config(mtq, quant: QuantConfig) -> dict:
    """ModelOpt's config of the mode; lm_head enabled with quantize_lm_head; AWQ blocks = the build's group size."""
    cfg = copy.deepcopy(getattr(mtq, CONFIGS[quant.mode]))
    entries = cfg["quant_cfg"]
    if quant.quantize_lm_head:
        entries = [e for e in entries if e.get("quantizer_name") != "*lm_head*"]
    if quant.mode == "int4_awq":
        for e in entries:
            if e.get("quantizer_name") == "*weight_quantizer":
                e["cfg"] = {**e["cfg"], "block_sizes": {**e["cfg"]["block_sizes"], -1: quant.group_size}}
    if quant.source_grid:  # the layers keep the checkpoint's blocks: only lm_head is calibrated
        entries = entries + [{"quantizer_name": "layers.*", "enable": False}]
    cfg["quant_cfg"] = entries
    if quant.mode == "int8_sq":
        cfg["algorithm"] = {"method": "smoothquant", "alpha": SMOOTHQUANT_ALPHA}
    return cfg


def projections(model: ModelConfig, quant: QuantConfig) -> list[str]:
    """Module names (= canonical stems) of the calibrated projections: the layers' (not when they keep the
    checkpoint's 4-bit blocks, quant.source_grid) and lm_head with quantize_lm_head."""
    stems = [] if quant.source_grid else [f"layers.{i}.{p}" for i in range(model.num_layers)
                                          for p in ("attention.qkv", "attention.dense", "mlp.gate_up", "mlp.down")]
    return stems + (["lm_head"] if quant.quantize_lm_head else [])


def _extract(module, mode: str, group_size: int | None) -> CalibratedWeight:
    """The calibrated weight of one ModelOpt QuantLinear: its (smoothed) weight, amaxes and input scale."""
    import torch
    wq, iq = module.weight_quantizer, module.input_quantizer
    weight = module.weight.detach().float()
    if getattr(wq, "_enable_pre_quant_scale", False) and getattr(wq, "pre_quant_scale", None) is not None:
        weight = weight * wq.pre_quant_scale.float()
    prequant = None
    if getattr(iq, "_enable_pre_quant_scale", False) and getattr(iq, "pre_quant_scale", None) is not None:
        prequant = iq.pre_quant_scale.detach().float().reshape(-1).numpy()
    amax = wq.amax
    if amax is None:  # not calibrated (never happens with a forward loop); ModelOpt's max calibrator's value
        amax = weight.abs().amax(dim=1) if mode == "int8_sq" else weight.abs().amax()
    amax = amax.detach().float().numpy()
    input_amax = None
    if mode == "fp8":
        input_amax = float(iq.amax.detach().float().max()) if iq.amax is not None else 0.0
    with torch.no_grad():
        return quantize_weight(mode, weight.numpy(), amax, input_amax=input_amax, prequant=prequant,
                               group_size=group_size)


def calibrated_model(model: ModelConfig, tensors: Mapping[str, np.ndarray], quant: QuantConfig,
                     opts: CalibrationOptions, tokenizer_dir: Path, start_token: int | None, max_positions: int,
                     sample: Sampler):
    """The CanonicalLM of the float tp-1 `tensors` after mtq.quantize (ModelOpt's fake-quant model) and a record of
    the calibration data for config.json. `tensors` is only read."""
    assert quant.mode in CALIBRATED, quant.mode
    mtq = import_modelopt(quant.mode)
    import torch
    from .torch_model import CanonicalLM

    lm = CanonicalLM(model, tensors, max_positions).eval()
    seqs, source = calibration_tokens(opts, tokenizer_dir, start_token if start_token is not None else 0,
                                      max_positions, sample)
    batches = _batches(seqs, opts.batch_size)

    def forward_loop(m):
        with torch.no_grad():
            for batch in batches:
                m(torch.tensor(batch))

    with contextlib.redirect_stdout(io.StringIO()):  # ModelOpt prints progress lines; the CLI shows its own
        lm = mtq.quantize(lm, modelopt_config(mtq, quant), forward_loop)
    record = {"data": source, "sequences": len(seqs), "tokens": sum(len(s) for s in seqs),
              "max_seq_len": max(len(s) for s in seqs), "modelopt_config": CONFIGS[quant.mode]}
    return lm, record


def calibrate(model: ModelConfig, tensors: Mapping[str, np.ndarray], quant: QuantConfig, opts: CalibrationOptions,
              tokenizer_dir: Path, start_token: int | None, max_positions: int, sample: Sampler) -> tuple[dict, dict]:
    """Calibrate `quant.mode`; returns (calibrated tensors by canonical name, the calibration record). `sample`
    draws the calibration text when no file is given (calibration_tokens)."""
    stems = projections(model, quant)
    if not stems:
        return {}, {"skipped": "the layers keep the checkpoint's 4-bit blocks and lm_head is not quantized"}
    lm, record = calibrated_model(model, tensors, quant, opts, tokenizer_dir, start_token, max_positions, sample)
    modules = dict(lm.named_modules())
    out: dict[str, np.ndarray] = {}
    for stem in stems:
        out.update(_extract(modules[stem], quant.mode, quant.group_size).tensors(stem))
    return out, record


def _batches(seqs: list[list[int]], size: int) -> list[list[list[int]]]:
    """Runs of equal-length sequences, at most `size` each (no padding: every token is real text)."""
    by_len: dict[int, list[list[int]]] = {}
    for s in seqs:
        by_len.setdefault(len(s), []).append(s)
    return [group[i:i + size] for group in by_len.values() for i in range(0, len(group), size)]
