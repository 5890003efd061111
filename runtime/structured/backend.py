"""llguidance against one engine's tokenizer: constraints compiled into matchers, and the token masks of a step.

The tokenizer's llguidance form (its token bytes, ~0.2 s for SmolLM2, ~1 s for Qwen2.5) is built on first use and
kept; a matcher then compiles in about a millisecond. Masks are bitmasks over the model's vocabulary (the logits'
width, which may exceed the tokenizer's: the padding ids are never allowed), computed by llguidance's executor,
which releases the GIL, so a step's masks are filled on a worker thread while the engine runs the step.
"""
from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.core.errors import EngineError

from .spec import StructuredOutputs, import_llguidance


@dataclass
class MaskRequest:
    matcher: object                  # llguidance.LLMatcher, at the sequence's committed tokens
    drafts: Sequence[int] = ()       # a row for the next token, then one after each draft


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self._engine_tokenizer, self.vocab_size = tokenizer, vocab_size   # runtime/tokenizer.py's
        self._eos = [int(t) for t in eos_token_ids]
        self._lock = threading.Lock()
        self._tokenizer = None
        self._executor = None
        self._worker = None

    def tokenizer(self):
        """The llguidance tokenizer (built once, on first use; call it ahead to warm it)."""
        with self._lock:
            if self._tokenizer is None:
                llguidance = import_llguidance()
                self._tokenizer = llguidance.LLTokenizer(self._engine_tokenizer.to_json(), n_vocab=self.vocab_size,
                                                         eos_token=self._eos or None)
            return self._tokenizer

    def matcher(self, spec: StructuredOutputs):
        """A fresh matcher for `spec`; EngineError(usage) naming the problem when llguidance refuses it (an
        invalid schema, regex or grammar, or a schema feature it cannot enforce)."""
        llguidance = import_llguidance()
        grammar = spec.grammar_text()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer())
        if is_error or messages:   # a warning is a part of the constraint that would not be enforced
            raise EngineError(f"invalid structured output: the {spec.kind} constraint cannot be enforced: "
                              f"{'; '.join(messages)}", usage=True)
        m = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise EngineError(f"invalid structured output: the {spec.kind} constraint cannot be enforced: "
                              f"{m.get_error()}", usage=True)
        return m

    def start_masks(self, requests: Sequence[MaskRequest]) -> concurrent.futures.Future:
        """The allowed-token rows of `requests` ([sum of 1 + len(drafts), bytes] packed, bitmask.py), computed on
        a worker thread; the matchers must not change until the future is done."""
        if self._worker is None:
            import llguidance
            self._executor = llguidance.LLExecutor()
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-grammar")
        return self._worker.submit(self._masks, list(requests))

    def _masks(self, requests: list[MaskRequest]) -> np.ndarray:
        import llguidance.numpy as lln
        rows, plain, drafted = 0, [], []
        for r in requests:
            if r.drafts:
                drafted.append((r.matcher, rows, list(r.drafts)))
            else:
                plain.append((r.matcher, rows))
            rows += 1 + len(r.drafts)
        bitmask = lln.allocate_token_bitmask(rows, self.vocab_size)
        if plain:
            lln.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafted:   # llguidance refuses an empty draft list here
            lln.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)
        return bitmask.view(np.uint8)     # packed rows (bitmask.py)


def consume(matcher, tokens: Sequence[int]) -> bool:
    """Advance `matcher` by committed tokens; whether the grammar is then complete (nothing may follow)."""
    if not matcher.consume_tokens([int(t) for t in tokens]):
        # every sampled token was allowed by the mask: a refusal here is a bug, never the request's fault
        raise RuntimeError(f"the grammar matcher refused tokens {list(tokens)}: {matcher.get_error()}")
    return matcher.is_stopped()


def valid_prefix(matcher, drafts: Sequence[int]) -> int:
    """How many of `drafts` the grammar allows, in order, from the matcher's state."""
    return matcher.validate_tokens([int(t) for t in drafts]) if drafts else 0
