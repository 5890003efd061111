"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the sequence's last n
tokens, n from prompt_lookup_max down to prompt_lookup_min, searched over its prompt and its output.

Input-grounded work (a code edit, a summary quoting its source) copies long runs of the prompt, which the lookup
finds after a few tokens of each run; it costs one vectorised comparison over the sequence a step, no model.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(token_ids: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens following the latest earlier match of the longest suffix of n_max .. n_min tokens; [] if none."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # windows starting at 0 .. length - 1 - n: each is followed by at least one token
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []
