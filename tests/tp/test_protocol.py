"""The step message: what rank 0 encodes is what the workers decode, and both build the same graph inputs."""
from __future__ import annotations

import numpy as np

from engine.runtime.step_inputs import SeqChunk, make_step_inputs
from engine.runtime.tp import protocol


def test_chunks_round_trip_and_give_the_same_step_inputs():
    rng = np.random.default_rng(0)
    chunks = [SeqChunk(rng.integers(0, 500, 13).tolist(), 0, [7, 2, 9, 4], True),
              SeqChunk([42], 30, [1, 3, 5, 6, 8, 10, 11, 12], True),
              SeqChunk(rng.integers(0, 500, 5).tolist(), 8, [0, 13, 14, 15], False),
              SeqChunk([42, 7, 9], 20, [16, 17, 18, 19, 20, 21], 3)]   # a decode verifying two speculated tokens
    head, payload = protocol.encode(chunks)
    assert head[0] == protocol.STEP and protocol.payload_size(head) == len(payload)
    decoded = protocol.decode(head, payload)
    assert [(list(c.token_ids), c.start_pos, list(c.block_table), c.num_logits) for c in decoded] == \
           [(list(c.token_ids), c.start_pos, list(c.block_table), int(c.num_logits)) for c in chunks]
    ours, theirs = make_step_inputs(chunks, 4, 8), make_step_inputs(decoded, 4, 8)
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
