"""The float reference of a quantized build (builder/reference.py): it samples the calibration text in seeded
batches, exactly what runtime/perplexity.sample_tokens samples from the same engine, and it is gone once the build
ends (a build that fails its gate leaves nothing either: tests/quantization/test_accuracy.py)."""
from __future__ import annotations

from engine.builder import reference as reference_module
from engine.builder.reference import ReferenceEngine
from engine.runtime.engine_dir import load_engine_config
from engine.runtime.perplexity import sample_tokens

from .calibrated_engines import TINY_CALIBRATION, calibrated_engine

KEY = "LlamaForCausalLM"


def test_samples_in_seeded_batches(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(reference_module, "SAMPLE_BATCH", 2)
    config = load_engine_config(tiny.engine(KEY))
    with ReferenceEngine(tiny.checkpoint(KEY), config, tmp_path) as ref:
        seqs = ref.sample(5, 12, 3, 1)
        expected = [s for k, n in enumerate((2, 2, 1))
                    for s in sample_tokens(ref.path(), sequences=n, length=12, seed=3 + k, start_token=1)]
        assert seqs == expected and ref.sample(5, 12, 3, 1) == seqs
        assert [len(s) for s in seqs] == [12] * 5 and all(s[0] == 1 for s in seqs) and len(set(map(tuple, seqs))) == 5
        assert ref.path().parent == tmp_path
    assert list(tmp_path.iterdir()) == []


def test_calibration_text_is_sampled_by_the_reference(tiny):
    engine = calibrated_engine(tiny, KEY, "int8_sq")
    record = load_engine_config(engine).quantization.calibration
    assert record["data"].startswith("sampled from the float reference engine")
    assert record["sequences"] == TINY_CALIBRATION.size and record["max_seq_len"] == TINY_CALIBRATION.max_seq_len
    assert not [p for p in engine.parent.iterdir() if p.name.startswith(".reference-")]

