"""The tp=N against tp=1 check shared by the tensor-parallel tests: same steps through both sessions, logits within
the float32 tolerance (tests/tolerances.py) and exactly the same greedy tokens."""
from __future__ import annotations

from engine.runtime.step_inputs import SeqChunk
from tests.builder.engines import engine_greedy
from tests.tolerances import assert_logits_close


def check_same_as_tp1(tp1, tpn, batch: list[list[int]], *, steps: int, what: str, dtype: str = "float32",
                      decode_dtype: str | None = None) -> None:
    """`batch` prefilled together in one step (last-token logits compared at `dtype`'s tolerance), then `steps`
    greedy tokens of its longest prompt through the paged cache (logits, at `decode_dtype`'s tolerance if given, and
    tokens compared)."""
    tpb = tp1.tokens_per_block
    tables, next_block = [], 0
    for ids in batch:
        n = -(-len(ids) // tpb)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    chunks = [SeqChunk(ids, 0, table, True) for ids, table in zip(batch, tables)]
    assert_logits_close(tpn.run(chunks), tp1.run(chunks), dtype, what=f"{what}: batched prefill")
    ids = max(batch, key=len)
    blocks = list(range(next_block, next_block + -(-(len(ids) + steps) // tpb)))
    ref_tokens, ref_logits = engine_greedy(tp1, ids, steps, blocks)
    tokens, logits = engine_greedy(tpn, ids, steps, blocks)
    assert_logits_close(logits, ref_logits, decode_dtype or dtype, what=f"{what}: greedy decode logits")
    assert tokens == ref_tokens, f"{what}: greedy tokens {tokens} != tp=1 {ref_tokens}"
