"""Speculative decoding: proposals of the next k tokens checked in one target step (engine_core.py runs it).

    config.py       SpeculativeConfig (`--speculative ngram|draft` and its options)
    ngram.py        prompt lookup: what followed the latest earlier occurrence of the last n tokens
    draft.py        a smaller engine with the same tokenizer proposes, batched, with its own KV pool
    speculator.py   which sequences propose this step (batch size, acceptance), and the counters
    verify.py       the accepted prefix plus one token: greedy exactly, rejection sampling with temperature
"""
from .config import SpeculativeConfig
from .speculator import NgramProposer, SpecDecodeStats, Speculator, make_speculator
from .verify import Verdict, verify

__all__ = ["NgramProposer", "SpecDecodeStats", "SpeculativeConfig", "Speculator", "Verdict", "make_speculator",
           "verify"]
