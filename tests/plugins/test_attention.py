"""plugins.attention: write_kv + paged_attention on a random block pool, both lowerings against a NumPy
reference that walks each sequence's context token by token, and against each other.

The step's index arrays are built here the way core/engine_format.py specifies them, from random block tables
over a shuffled pool, with sequences mixing fresh prefills, chunked prefills (history already in the pool) and
decodes, so padded query rows and padded context slots are always present.
"""
from dataclasses import dataclass

import numpy as np
import pytest

from engine.core.errors import EngineError
from engine.core.model_config import RopeConfig
from engine.plugins.attention import paged_attention, rotary_paged_attention, write_kv
from engine.plugins.rotary import rotary_tables

from .runner import AVX2_ONLY, PLAIN, assert_close, library_without, node_names, run_op

BLOCK = 4   # tokens per block: small, so contexts span many scattered blocks


@dataclass
class Step:
    """One scheduler step over a random pool: the graph inputs plus what the reference needs."""
    feeds: dict
    contexts: list      # per sequence: pool slots of its context tokens, in position order
    q_rows: list        # per sequence: packed indices of its new tokens
    positions: np.ndarray   # [T] position of each packed token in its sequence


def make_step(rng, seqs, num_kv_heads, head_dim, num_heads, num_blocks=None, window=None) -> Step:
    """seqs: (context length after this step, new tokens) per sequence; a pool of num_blocks (default: 8 more
    than the contexts need, at least 64)."""
    kv_size = num_kv_heads * head_dim
    num_blocks = num_blocks or max(64, sum(-(-ctx // BLOCK) for ctx, _ in seqs) + 8)
    free = list(rng.permutation(num_blocks))
    contexts, q_rows, slots, positions = [], [], [], []
    for ctx, new in seqs:
        blocks = [free.pop() for _ in range(-(-ctx // BLOCK))]
        table = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)]
        contexts.append(table)
        q_rows.append(list(range(len(slots), len(slots) + new)))
        slots += table[ctx - new:]
        positions += list(range(ctx - new, ctx))
    tokens, batch = len(slots), len(seqs)
    q_max, l_max = max(n for _, n in seqs), max(c for c, _ in seqs)
    q_index = np.zeros((batch, q_max), np.int64)
    kv_slots = np.zeros((batch, l_max), np.int64)
    mask = np.zeros((batch, 1, q_max, l_max), bool)
    out_index = np.zeros(tokens, np.int64)
    for b, (ctx, new) in enumerate(seqs):
        q_index[b, :new] = q_rows[b]
        kv_slots[b, :ctx] = contexts[b]
        for j in range(new):
            p = ctx - new + j
            lo = 0 if window is None else max(0, p - window + 1)
            mask[b, 0, j, lo:p + 1] = True
            out_index[q_rows[b][j]] = b * q_max + j
    num_slots = num_blocks * BLOCK
    feeds = {
        "q": rng.standard_normal((tokens, num_heads * head_dim)).astype(np.float32),
        "k": rng.standard_normal((tokens, kv_size)).astype(np.float32),
        "v": rng.standard_normal((tokens, kv_size)).astype(np.float32),
        # Stale values everywhere in the pool: what is not this step's context must not matter.
        "kcache": (rng.standard_normal((num_slots, kv_size)) * 3).astype(np.float32),
        "vcache": (rng.standard_normal((num_slots, kv_size)) * 3).astype(np.float32),
        "slot_mapping": np.array(slots, np.int64),
        "q_index": q_index, "kv_slots": kv_slots, "attn_mask": mask, "out_index": out_index,
    }
    return Step(feeds, contexts, q_rows, np.array(positions, np.int64))


def reference(step: Step, num_heads, num_kv_heads, head_dim, scale, softcap, window=None) -> np.ndarray:
    """Per token, per head: softmax over its visible context (float64), the pools updated with the new K/V."""
    f = step.feeds
    kpool, vpool = f["kcache"].astype(np.float64), f["vcache"].astype(np.float64)
    kpool[f["slot_mapping"]], vpool[f["slot_mapping"]] = f["k"], f["v"]
    group = num_heads // num_kv_heads
    out = np.zeros(f["q"].shape)
    for table, rows in zip(step.contexts, step.q_rows):
        for j, t in enumerate(rows):
            p = len(table) - len(rows) + j
            visible = table[0 if window is None else max(0, p - window + 1): p + 1]
            for h in range(num_heads):
                kv = slice((h // group) * head_dim, (h // group + 1) * head_dim)
                q = f["q"][t, h * head_dim:(h + 1) * head_dim].astype(np.float64)
                s = kpool[visible, kv] @ q * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                w = np.exp(s - s.max())
                out[t, h * head_dim:(h + 1) * head_dim] = (w / w.sum()) @ vpool[visible, kv]
    return out.astype(np.float32)


# how paged_attention lowers: the MatMul/Softmax reference, the opset-23 Attention plugin over the gathered context,
# or the engine's kernel reading the pools in place (plugins/kernels/paged_attention.cc)
LOWERINGS = {"reference": {"plugin": False}, "attention": {"plugin": True},
             "kernel": {"plugin": True, "kernel": True}}


def attention_graph(num_heads, num_kv_heads, head_dim, scale, softcap, lowering):
    def fn(g, q, k, v, kcache, vcache, slot_mapping, q_index, kv_slots, attn_mask, out_index):
        kc = write_kv(g, kcache, slot_mapping, k, name="/model/layers.0/attn/k_cache")
        vc = write_kv(g, vcache, slot_mapping, v, name="/model/layers.0/attn/v_cache")
        return paged_attention(g, q, kc, vc, q_index=q_index, kv_slots=kv_slots, mask=attn_mask,
                               out_index=out_index, num_heads=num_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, scale=scale, softcap=softcap,
                               name="/model/layers.0/attn/attention", **LOWERINGS[lowering])
    return fn


STEPS = {
    "prefill": [(23, 23)],
    "decode-one": [(45, 1)],   # fewer keys than two segments of 64 (attention_decode.h): one work item
    "decode-one-long": [(200, 1)],   # split in 3 shares of whole segments (flash-decoding), combined after
    "decode-batch": [(9, 1), (40, 1), (1, 1), (17, 1)],
    "mixed": [(30, 30), (61, 1), (37, 12), (5, 1), (16, 4)],   # prefill, decode, chunked prefills
    # the kernel's prefill tiles (attention_tiles.h): rows of >= 4 tokens in tiles of up to 32 query rows, a short
    # last tile, a row of 3 tokens attended one by one beside them
    "tiles": [(100, 75), (50, 3), (41, 33)],
    # decodes longer than the kernel's key chunks (attention_decode.h's kChunk, 32): merged online across chunks
    "long-decode": [(600, 1), (300, 1)],
    # enough decodes that a work item takes several in a row, each prefetching the next one's keys (19: items of
    # 2 and a last of 1), some longer than a key chunk, beside a prefill's tiles
    "many-decodes": [(1 + 37 * i % 290, 1) for i in range(19)] + [(20, 8)],
}


@pytest.mark.parametrize("lowering", list(LOWERINGS))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (8, 2, 32), (10, 2, 12)])
@pytest.mark.parametrize("steps", list(STEPS))
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_paged_attention(lowering, num_heads, num_kv_heads, head_dim, steps, softcap):
    """(10, 2, 12): a group of 5 query heads (the kernel's runs of 3 and 2) and a head size the kernel's 8-lane
    path does not take."""
    rng = np.random.default_rng(7)
    step = make_step(rng, STEPS[steps], num_kv_heads, head_dim, num_heads)
    scale = head_dim ** -0.5 * (2.0 if softcap else 1.0)   # larger scores so the softcap really bends them
    y = run_op(attention_graph(num_heads, num_kv_heads, head_dim, scale, softcap, lowering), step.feeds)
    assert_close(y, reference(step, num_heads, num_kv_heads, head_dim, scale, softcap))


@pytest.mark.parametrize("steps", ["decode-one", "mixed", "many-decodes"])
def test_kernel_on_two_threads_equals_one(steps):
    """The kernel's work items run on ORT's intra-op threads: the result must not depend on how many."""
    rng = np.random.default_rng(11)
    step = make_step(rng, STEPS[steps], 3, 64, 9)
    graph = attention_graph(9, 3, 64, 0.125, None, "kernel")
    np.testing.assert_array_equal(run_op(graph, step.feeds, threads=2), run_op(graph, step.feeds, threads=1))


@pytest.mark.parametrize("context", [45, 64, 65, 300, 1000])
def test_a_token_gets_the_same_floats_alone_or_beside_others(context):
    """A lone decode's keys are split over the threads, the same token beside four others is not: its output must
    be the same to the bit, which keeps speculative greedy decoding (runtime/speculative/) token-identical."""
    rng = np.random.default_rng(13)
    together = make_step(rng, [(context, 1), (50, 1), (70, 1), (130, 1), (20, 1)], 2, 64, 8).feeds
    alone = {**together, "q": together["q"][:1], "k": together["k"][:1], "v": together["v"][:1],
             "slot_mapping": together["slot_mapping"][:1], "q_index": np.zeros((1, 1), np.int64),
             "kv_slots": together["kv_slots"][:1, :context], "attn_mask": together["attn_mask"][:1, :, :, :context],
             "out_index": np.zeros(1, np.int64)}
    graph = attention_graph(8, 2, 64, 0.125, None, "kernel")
    np.testing.assert_array_equal(run_op(graph, alone, threads=2)[0], run_op(graph, together, threads=2)[0])


@pytest.mark.parametrize("flags", [AVX2_ONLY, PLAIN], ids=["avx2", "plain"])
@pytest.mark.parametrize("steps", ["long-decode", "tiles"])
def test_kernel_on_narrower_cpus_computes_the_same(steps, flags, tmp_path, monkeypatch):
    """The kernel library compiled without AVX-512 (8-lane vectors, as on AVX2-only CPUs) or without AVX2 (plain
    loops) computes the same as this CPU's build."""
    step = make_step(np.random.default_rng(12), STEPS[steps], 3, 64, 9)
    graph = attention_graph(9, 3, 64, 0.125, None, "kernel")
    native_build = run_op(graph, step.feeds, threads=2)
    library_without(monkeypatch, tmp_path, *flags)
    narrow = run_op(graph, step.feeds, threads=2)
    assert_close(narrow, native_build)
    assert_close(narrow, reference(step, 9, 3, 64, 0.125, None))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (6, 3)])
def test_lowerings_agree_with_sliding_window_mask(num_heads, num_kv_heads):
    """The mask is the only thing that differs for sliding layers; both lowerings must honour any mask."""
    rng = np.random.default_rng(8)
    step = make_step(rng, STEPS["mixed"], num_kv_heads, 32, num_heads, window=8)
    expected = reference(step, num_heads, num_kv_heads, 32, 0.2, None, window=8)
    ours = [run_op(attention_graph(num_heads, num_kv_heads, 32, 0.2, None, lowering), step.feeds)
            for lowering in LOWERINGS]
    for y in ours:
        assert_close(y, expected)
    assert_close(ours[0], ours[1])
    assert_close(ours[0], ours[2])


def rotate_half(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, heads: int) -> np.ndarray:
    """NumPy rotary of x [T, heads*hd] (plugins/rotary.py's formula)."""
    t, hd = len(x), x.shape[1] // heads
    x = x.reshape(t, heads, hd)
    c, s = cos[positions][:, None], sin[positions][:, None]
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(t, -1)


def rotary_step(rng, seqs, num_heads, num_kv_heads, head_dim):
    """A step for RotaryPagedAttention, the feeds in its input order, and the expected (out, kcache, vcache)."""
    step = make_step(rng, seqs, num_kv_heads, head_dim, num_heads)
    cos, sin = rotary_tables(head_dim, RopeConfig(theta=10000.0), 1024)
    f = step.feeds
    feeds = {"qkv": np.concatenate([f["q"], f["k"], f["v"]], axis=1), "positions": step.positions, "cos": cos,
             "sin": sin, **{n: f[n] for n in ("kcache", "vcache", "slot_mapping", "q_index", "kv_slots",
                                                "attn_mask", "out_index")}}
    f["q"] = rotate_half(f["q"], step.positions, cos, sin, num_heads)
    f["k"] = rotate_half(f["k"], step.positions, cos, sin, num_kv_heads)
    kcache, vcache = f["kcache"].copy(), f["vcache"].copy()
    kcache[f["slot_mapping"]], vcache[f["slot_mapping"]] = f["k"], f["v"]
    return step, feeds, (kcache, vcache)


def rotary_graph(num_heads, num_kv_heads, scale, softcap):
    def fn(g, qkv, positions, cos, sin, kcache, vcache, slot_mapping, q_index, kv_slots, attn_mask, out_index):
        return rotary_paged_attention(g, qkv, positions, cos, sin, kcache, vcache, slot_mapping, q_index=q_index,
                                      kv_slots=kv_slots, mask=attn_mask, out_index=out_index, num_heads=num_heads,
                                      num_kv_heads=num_kv_heads, scale=scale, softcap=softcap,
                                      name="/model/layers.0/attn/paged_attention")
    return fn


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (10, 2, 12)])
@pytest.mark.parametrize("steps", list(STEPS))
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_rotary_paged_attention(num_heads, num_kv_heads, head_dim, steps, softcap):
    """The fused kernel: rotary of q and k, the K/V rows written, attention; each against NumPy."""
    step, feeds, (kcache, vcache) = rotary_step(np.random.default_rng(7), STEPS[steps], num_heads, num_kv_heads,
                                                head_dim)
    scale = head_dim ** -0.5 * (2.0 if softcap else 1.0)
    out, k_out, v_out = run_op(rotary_graph(num_heads, num_kv_heads, scale, softcap), feeds, threads=2)
    assert_close(k_out, kcache)
    np.testing.assert_array_equal(v_out, vcache)
    assert_close(out, reference(step, num_heads, num_kv_heads, head_dim, scale, softcap))


def test_rotary_paged_attention_rejects_a_position_beyond_the_tables():
    _, feeds, _ = rotary_step(np.random.default_rng(3), STEPS["decode-one"], 4, 2, 16)
    feeds["positions"] = feeds["positions"] + len(feeds["cos"])
    with pytest.raises(Exception, match="RotaryPagedAttention: a position is beyond the rotary tables"):
        run_op(rotary_graph(4, 2, 0.25, None), feeds)


def test_write_kv_updates_only_the_mapped_slots():
    rng = np.random.default_rng(9)
    cache = rng.standard_normal((40, 12)).astype(np.float32)
    slots = rng.permutation(40)[:7].astype(np.int64)
    new = rng.standard_normal((7, 12)).astype(np.float32)
    y = run_op(lambda g, c, s, n: write_kv(g, c, s, n, name="/w"), {"c": cache, "s": slots, "n": new})
    expected = cache.copy()
    expected[slots] = new
    np.testing.assert_array_equal(y, expected)


def test_node_names():
    step = make_step(np.random.default_rng(0), [(3, 1)], 1, 8, 2)
    names = node_names(attention_graph(2, 1, 8, 0.3, None, "attention"), step.feeds)
    assert names == ["/model/layers.0/attn/k_cache/Unsqueeze", "/model/layers.0/attn/k_cache/ScatterND",
                     "/model/layers.0/attn/v_cache/Unsqueeze", "/model/layers.0/attn/v_cache/ScatterND",
                     "/model/layers.0/attn/attention/Gather", "/model/layers.0/attn/attention/Gather_1",
                     "/model/layers.0/attn/attention/Gather_2", "/model/layers.0/attn/attention/Attention",
                     "/model/layers.0/attn/attention/Reshape", "/model/layers.0/attn/attention/Gather_3"]
    names = node_names(attention_graph(2, 1, 8, 0.3, None, "kernel"), step.feeds)
    assert names[4:] == ["/model/layers.0/attn/attention/PagedAttention"]


def test_rejects_bad_head_counts():
    step = make_step(np.random.default_rng(0), [(3, 1)], 2, 8, 3)
    with pytest.raises(EngineError, match="multiple"):
        run_op(attention_graph(3, 2, 8, 0.3, None, "attention"), step.feeds)


@pytest.mark.parametrize("steps", list(STEPS))
def test_quant_rotary_paged_attention_equals_its_projection_then_attention(steps):
    """Where the engine's QuantMatMul makes the q|k|v that only RotaryPagedAttention reads, the attention node
    takes the projection in (QuantRotaryPagedAttention, plugins/attention._fold_projection): the same output and
    K/V rows, bit for bit, as the two nodes."""
    from engine.plugins.graph import ENGINE_DOMAIN
    from engine.plugins import quant_matmul
    from tests.plugins.test_quant_matmul import q4_1_weight
    heads, kv_heads, hd = 9, 3, 64
    step, feeds, _ = rotary_step(np.random.default_rng(5), STEPS[steps], heads, kv_heads, hd)
    tokens = len(feeds.pop("qkv"))
    x = np.random.default_rng(6).standard_normal((tokens, 96)).astype(np.float32)
    q = q4_1_weight((heads + 2 * kv_heads) * hd, 96, 7)
    ops = {}

    def graph(reader: bool):
        def fn(g, xs, *rest):
            qkv = g.scope("/qkv")("QuantMatMul", [xs, g.weight("qkv.weight", quant_matmul.pack(q))],
                                  domain=ENGINE_DOMAIN, N=q.shape[0], bits=q.bits, group_size=q.group_size,
                                  offsets=1)
            if reader:
                g.scope("/other")("Relu", [qkv])
            out = rotary_graph(heads, kv_heads, hd ** -0.5, None)(g, qkv, *rest)
            ops[reader] = [n.op_type for n in g.nodes if n.op_type != "Identity"]
            return out
        return fn

    folded = run_op(graph(False), {"x": x, **feeds}, threads=2)
    apart = run_op(graph(True), {"x": x, **feeds}, threads=2)
    assert ops == {False: ["QuantRotaryPagedAttention"], True: ["QuantMatMul", "Relu", "RotaryPagedAttention"]}
    for a, b in zip(folded, apart):
        np.testing.assert_array_equal(a, b)
