"""The allowed-token masks of a step, as llguidance fills them: one bit per token id, little-endian within bytes
(token t is bit t % 8 of byte t // 8), padded to 32-bit words. Kept packed (19 KB a row for a 152k vocabulary) and
unpacked only for the rows that need every bit."""
from __future__ import annotations

import numpy as np


def allows(mask: np.ndarray, token: int) -> bool:
    """Whether the packed uint8 `mask` lets `token` through."""
    return bool((mask[token >> 3] >> (token & 7)) & 1)


def unpack(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The bool [vocab_size] form of the packed uint8 `mask`."""
    return np.unpackbits(mask, count=vocab_size, bitorder="little").view(bool)


def masked_argmax(logits: np.ndarray, mask: np.ndarray) -> int:
    """The first largest logit among the tokens `mask` allows: the plain argmax when it is allowed (most steps, the
    model already follows the format), else the argmax with the others at -inf."""
    tok = int(np.argmax(logits))
    if allows(mask, tok):
        return tok
    return int(np.argmax(np.where(unpack(mask, logits.shape[0]), logits, -np.inf)))
