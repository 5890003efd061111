"""plugins.lora: the engine's LoraAdd kernel and the standard-ONNX reference against NumPy, for a step of tokens that
use different adapters (and none), each row block adding to its own columns; a token's floats do not depend on the
tokens beside it."""
import ml_dtypes
import numpy as np
import pytest

from engine.plugins.lora import lora_add, lora_add_numpy

from .runner import PLAIN, assert_close, library_without, run_op

K, N, SLOTS, RANK = 40, 56, 4, 3
COLUMNS = [0, 24, 24, 40, 40, 56]    # three row blocks: q | k | v of a qkv projection


def adapters(rng, slots=SLOTS, rank=RANK, columns=COLUMNS):
    blocks = len(columns) // 2
    a = rng.standard_normal((slots, blocks * rank, K)).astype(np.float32)
    b = np.zeros((slots, blocks * rank, N), dtype=np.float32)
    for m in range(blocks):   # each block's rows only over its own columns, as the runtime stores them
        c0, c1 = columns[2 * m: 2 * m + 2]
        b[:, m * rank:(m + 1) * rank, c0:c1] = rng.standard_normal((slots, rank, c1 - c0))
    a[0] = b[0] = 0           # slot 0: no adapter
    a[2, RANK - 1] = b[2, RANK - 1] = 0   # a zero-padded rank row of a lower-rank adapter
    return a, b


def feeds(rng, tokens):
    a, b = adapters(rng)
    return {"y": rng.standard_normal((tokens, N)).astype(np.float32),
            "x": rng.standard_normal((tokens, K)).astype(np.float32),
            "index": rng.integers(0, SLOTS, tokens).astype(np.int64), "a": a, "b": b}


def run(f, kernel, **kw):
    bf16 = f["a"].dtype == ml_dtypes.bfloat16
    return run_op(lambda g, y, x, i, a, b: lora_add(g, y, x, i, a, b, columns=COLUMNS, name="/lora", kernel=kernel,
                                                    bf16=bf16), f, **kw)


def as_bf16(f):
    return {**f, "a": f["a"].astype(ml_dtypes.bfloat16), "b": f["b"].astype(ml_dtypes.bfloat16)}


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_bfloat16_adapters_match_numpy_of_the_rounded_values(kernel, tokens):
    f = as_bf16(feeds(np.random.default_rng(tokens), tokens))
    widened = {**f, "a": f["a"].astype(np.float32), "b": f["b"].astype(np.float32)}
    assert_close(run(f, kernel=kernel), lora_add_numpy(*widened.values(), COLUMNS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_reference_matches_numpy(tokens):
    f = feeds(np.random.default_rng(tokens), tokens)
    assert_close(run(f, kernel=False), lora_add_numpy(*f.values(), COLUMNS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens,pool", [(1, None), (5, None), (37, 2), (130, 2)])
def test_kernel_matches_numpy(tokens, pool):
    f = feeds(np.random.default_rng(tokens), tokens)
    out = run(f, kernel=True, pool=pool)
    assert_close(out, lora_add_numpy(*f.values(), COLUMNS), rtol=1e-4, atol=1e-4)
    no_adapter = f["index"] == 0
    np.testing.assert_array_equal(out[no_adapter], f["y"][no_adapter])   # slot 0 tokens are copied exactly


def test_kernel_splits_a_wide_module_over_column_chunks():
    columns, n = [0, 2100, 2100, 2500], 2500      # 1024-column items: the first block takes three
    rng = np.random.default_rng(5)
    a = rng.standard_normal((3, 2 * RANK, K)).astype(np.float32)
    b = rng.standard_normal((3, 2 * RANK, n)).astype(np.float32)
    b[:, :RANK, 2100:] = b[:, RANK:, :2100] = 0
    a[0] = b[0] = 0
    f = {"y": rng.standard_normal((6, n)).astype(np.float32), "x": rng.standard_normal((6, K)).astype(np.float32),
         "index": np.array([1, 2, 0, 2, 1, 1]), "a": a, "b": b}
    out = run_op(lambda g, y, x, i, a_, b_: lora_add(g, y, x, i, a_, b_, columns=columns, name="/lora", kernel=True),
                 f, pool=2)
    assert_close(out, lora_add_numpy(*f.values(), columns), rtol=1e-4, atol=1e-4)


def test_kernel_token_alone_equals_token_in_batch():
    f = feeds(np.random.default_rng(7), 23)
    batched = run(f, kernel=True, pool=2)
    for t in (0, 11, 22):
        alone = run({k: (v[t:t + 1] if k in ("y", "x", "index") else v) for k, v in f.items()}, kernel=True)
        np.testing.assert_array_equal(alone[0], batched[t])


def test_kernel_without_avx2(monkeypatch, tmp_path):
    library_without(monkeypatch, tmp_path, *PLAIN)
    f = feeds(np.random.default_rng(3), 9)
    assert_close(run(f, kernel=True), lora_add_numpy(*f.values(), COLUMNS), rtol=1e-4, atol=1e-4)
    b = as_bf16(f)
    widened = {**b, "a": b["a"].astype(np.float32), "b": b["b"].astype(np.float32)}
    assert_close(run(b, kernel=True), lora_add_numpy(*widened.values(), COLUMNS), rtol=1e-4, atol=1e-4)


def test_kernel_refuses_an_index_out_of_range():
    f = feeds(np.random.default_rng(1), 4)
    f["index"][2] = SLOTS
    with pytest.raises(Exception, match="index out of"):
        run(f, kernel=True)
