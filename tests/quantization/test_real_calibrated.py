"""SmolLM2-135M-Instruct calibrated at build (ModelOpt on CPU): int8_sq, fp8 and int4_awq engines know the capital of
France, carry an accuracy report within the issue's targets (int8_sq, int4_awq; fp8 not yet: see BELOW_TARGET),
hold their weights at their precision and run the intended kernels. This checkpoint's layers are GGUF Q4_1 blocks:
int4_awq keeps them (AWQ runs on lm_head only, in the lm_head build).

Calibration is kept small (16 self-sampled sequences of 128 tokens) so the module builds in minutes on two cores;
the build's default is 512 x 512. The whole module (float32, three calibrated builds with their reports, two lm_head
builds) measured 6 min on two otherwise idle cores; when int4_awq still ran AWQ over every layer it alone took
~27 min (AWQ-lite's scale search runs the model once per candidate). The answer is checked
teacher-forced (after "The capital of France is" the engine says " Paris"): the float32 engine's free-running answer
starts on a near-tie (tests/quantization/test_real_model.py).
"""
from __future__ import annotations

import pytest

from engine.builder.build import build_engine
from engine.builder.onnxruntime_backend import op_counts
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.core.model_config import QuantConfig
from engine.quantization.accuracy import AccuracyOptions
from engine.quantization.modelopt_calibration import CalibrationOptions
from tests.real_model import next_token_after_france

from .engines import PROJECTION_OP, projections

pytestmark = pytest.mark.slow

BUILD = BuildConfig(max_batch_size=8, max_input_len=512, max_seq_len=1024, max_num_tokens=1024)
CALIBRATION = CalibrationOptions(size=16, max_seq_len=128)
TARGET = {"int8_sq": 2.0, "fp8": 2.0, "int4_awq": 6.0}    # perplexity increase, percent (the targets)
KERNEL = {"int8_sq": "MatMulInteger", "fp8": "QuantizeLinear", "int4_awq": PROJECTION_OP}
# The size limits are met with lm_head quantized too (the tied embedding reads its int8 / int4 table): these
# second builds skip the report; the accuracy targets are those of the default builds (lm_head float, as ModelOpt).
LM_HEAD_BUILDS = ("int8_sq", "int4_awq")


@pytest.fixture(scope="module")
def engines(smollm2_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2_calibrated")
    build_engine(smollm2_checkpoint, root / "float32", BUILD, PluginConfig())
    for mode in TARGET:
        build_engine(smollm2_checkpoint, root / mode, BUILD, PluginConfig(), quant=QuantConfig(mode=mode),
                     accuracy=AccuracyOptions(), calibration=CALIBRATION)
    for mode in LM_HEAD_BUILDS:
        build_engine(smollm2_checkpoint, root / f"{mode}_lm_head", BUILD, PluginConfig(),
                     quant=QuantConfig(mode=mode, quantize_lm_head=True), accuracy=AccuracyOptions(eval_tokens=0),
                     calibration=CALIBRATION)
    return root


@pytest.mark.parametrize("mode", sorted(TARGET))
def test_knows_the_capital_of_france(engines, mode):
    assert next_token_after_france(engines / mode) == " Paris"


# Measured with this module's 16 x 128 calibration (report on 2040 tokens the float32 engine samples, its ppl 29.77):
# int8_sq +1.09% (30.09) with per-token activation scales (it was +24.0% with DynamicQuantizeMatMul's one scale per
#   step: SmolLM2's outlier tokens flattened the others).
# fp8 +4.21% (31.02), ModelOpt's FP8_DEFAULT_CFG. Ablated in torch (GPL-3 text, all projections +3.97%): fp8 weights
#   alone +2.10%, activations alone +1.74%; all but attention.qkv +0.40%, all but mlp.gate_up +1.22%, dense or down
#   left out no better. e4m3 keeps 3 mantissa bits (2.6% RMS weight error) whatever the scale: per-channel weight
#   scales measured +4.59% in the engine. Second ablation (torch fake-quant, 16 x 128 calibration, 8 x 256 tokens the
#   torch model sampled, seed 0; all projections +5.16%): weights alone +2.76%, activations alone +3.01% static per
#   tensor, +2.28% dynamic per token (all with per-token activations +4.25%); attention.qkv's weights alone +0.86%,
#   its activations alone +1.37%; all but qkv +3.55% on this text (+0.40% on GPL-3 text); keeping q, k, v or q+k rows
#   of qkv float: +3.75..4.95%; leaving out one layer's qkv (0, 1, 2, 29): +3.45..5.23% (the noise of 2040 tokens
#   is ~1%). No single projection carries the loss, and e4m3 activations alone cost more than the 2% target on this
#   text: the target needs mixed precision (ModelOpt's auto_quantize) or error-compensating rounding, not a scale.
#   Third (bench/NOTES.md entry 18): every weight/activation granularity pair >= +3.47%; leaving one projection kind
#   or one layer float32 >= +3.04%.
# int4_awq +0.41% (29.89): the layers keep the checkpoint's Q4_1 blocks (builder/build.resolve_quant). AWQ at group
#   64 over them (what the build did before) measured +56.3% (46.52, lm_head and the tied embedding int4 too).
# Strict xfail: it fails loudly (XPASS) once a change meets the target, so the mark is then removed.
BELOW_TARGET = {"fp8": pytest.mark.xfail(strict=True, reason="measured fp8 +4.2% (target 2%)")}


@pytest.fixture(scope="module")
def more_texts(engines):
    """Held-out text of seeds 1-3, sampled once by the float32 engine for every mode (the same text each time)."""
    from engine.quantization.accuracy import held_out_windows
    from engine.runtime.engine_dir import load_engine_config
    reference, bos = engines / "float32", load_engine_config(engines / "float32").generation.bos_token_id
    return [held_out_windows(AccuracyOptions(seed=seed), reference, reference, bos) for seed in (1, 2, 3)]


@pytest.mark.parametrize("mode", [pytest.param(m, marks=BELOW_TARGET.get(m, ())) for m in sorted(TARGET)])
def test_accuracy_report_within_target(engines, more_texts, mode):
    """The build's report (held-out text of seed 0), and the target on the mean of it and three more texts: one
    text's estimate is noisy, int8_sq's read +1.2% to +2.2% over the seeds 0-5, and which text seed 0 gives moves
    with the float engine's summation order (temperature-1 sampling: MLAS's MatMul and the float32 tiles sample
    texts that part after 30-175 tokens; bench/NOTES.md entry 49)."""
    from engine.quantization.accuracy import accuracy_report
    from engine.runtime.engine_dir import load_engine_config
    q = load_engine_config(engines / mode).quantization
    assert q.accuracy["tokens"] >= 2000 and q.accuracy["reference_ppl"] > 1
    increases = [q.accuracy["ppl_increase_pct"]] + [
        accuracy_report(engines / "float32", engines / mode, text)["ppl_increase_pct"] for text in more_texts]
    assert sum(increases) / len(increases) <= TARGET[mode], increases
    if mode == "int4_awq":  # the layers keep the checkpoint's Q4_1 blocks: nothing to calibrate
        assert q.source_grid and "skipped" in q.calibration
    else:
        assert q.calibration["sequences"] == 16 and q.calibration["max_seq_len"] == 128


@pytest.mark.parametrize("mode", sorted(TARGET))
def test_kernels_and_weight_precision(engines, mode):
    engine = engines / (f"{mode}_lm_head" if mode in LM_HEAD_BUILDS else mode)
    counts = op_counts(engine / "rank0.onnx")
    kernels = projections(counts, KERNEL[mode])
    assert kernels == 30 * 4 + (mode in LM_HEAD_BUILDS)
    fp32 = (engines / "float32" / "rank0.onnx.data").stat().st_size
    # fp8 keeps the float32 tied embedding (ONNX Gather takes no float8): 113 MB of the 538 MB. int4_awq keeps the
    # layers' Q4_1 blocks: float16 scales, float32 offsets (0.179x measured for int4_wo; the issue asks 0.18x)
    limit = {"int8_sq": 0.30, "fp8": 0.45, "int4_awq": 0.18}[mode]
    assert (engine / "rank0.onnx.data").stat().st_size <= limit * fp32
