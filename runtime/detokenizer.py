r"""Incremental, UTF-8-safe detokenization of one request's output, and its stop strings.

vLLM's prefix/read-offset scheme: tokens are decoded as a small window that starts a few tokens back
(`prefix_offset`) so that decoders which depend on the previous token (leading spaces, byte-level merges) see it;
the text of the new tokens is the window's text minus the text of the window without them:

    ids:  ... | prefix_offset ........ read_offset | new tokens |
                \__ prefix_text ______/
                \__ new_text ______________________________/     delta = new_text[len(prefix_text):]

A delta that ends in U+FFFD is a multibyte character split across tokens: nothing is emitted and the offsets do
not move until a later token completes it, so no partial character or replacement character from a split byte
sequence is ever emitted. An incomplete character at the very end of a finished output is dropped (as vLLM does).

Stop strings are searched in the text, across token boundaries; the output is cut before the stop string (kept
with include_stop_str_in_output). When streaming with stop strings, the last max_stop_len - 1 characters are held
back until the request finishes, so a stop string that is still being completed never reaches the client.
"""
from __future__ import annotations

from typing import Sequence

from .sampling_params import SamplingParams
from .tokenizer import Tokenizer

# Tokens of the prompt decoded before the first output token (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
INITIAL_OFFSET = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.ids: list[int] = list(prompt_token_ids)
        self.prefix_offset = max(len(self.ids) - INITIAL_OFFSET, 0)
        self.read_offset = len(self.ids)
        self.output_text = ""
        self._emitted = 0          # characters of output_text already returned by take_delta
        self._stopped = False

    def update(self, new_token_ids: Sequence[int], *, stop_terminated: bool = False,
               check_stop: bool = True) -> str | None:
        """Add sampled tokens; returns the stop string that matched, if any (the text is then final).

        With stop_terminated (the last token is eos or a stop token id) that token is not detokenized; without
        check_stop (fewer than min_tokens generated) stop strings are not looked for."""
        if self._stopped:
            return None
        new_token_ids = list(new_token_ids)
        if stop_terminated and new_token_ids:
            new_token_ids = new_token_ids[:-1]
        before = len(self.output_text)
        for tok in new_token_ids:
            self.ids.append(tok)
            self.output_text += self._decode_step()
        return self._check_stop(before) if check_stop else None

    def _decode_step(self) -> str:
        skip = self.params.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]

    def _check_stop(self, before: int) -> str | None:
        stops = self.params.stop
        if not stops or len(self.output_text) == before:
            return None
        # A match must end in the new text; it may start up to max_stop_len - 1 characters before it.
        start = max(before - self.params.max_stop_len + 1, 0)
        best: tuple[int, str] | None = None
        for s in stops:
            i = self.output_text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.output_text = self.output_text[:i + len(s) if self.params.include_stop_str_in_output else i]
        self._stopped = True
        return s

    @property
    def emitted_text(self) -> str:
        """All text returned by take_delta so far."""
        return self.output_text[:self._emitted]

    def take_delta(self, *, finished: bool) -> str:
        """Text not yet returned; while unfinished, holds back a possible beginning of a stop string."""
        end = len(self.output_text)
        if not finished and self.params.stop:
            end = max(self._emitted, end - (self.params.max_stop_len - 1))
        delta = self.output_text[self._emitted:end]
        self._emitted = end
        return delta
