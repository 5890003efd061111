"""Incremental detokenization (UTF-8 safe) and stop strings across token boundaries."""
import pytest

from engine.runtime import SamplingParams, Tokenizer
from engine.runtime.detokenizer import IncrementalDetokenizer

TEXT = "The capital of France is Paris. naïve café — über 東京 ✓ emoji 🙂 done."


def stream(tok, prompt_ids, out_ids, params=SamplingParams()):
    d = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas = []
    for t in out_ids:
        d.update([t])
        deltas.append(d.take_delta(finished=False))
    deltas.append(d.take_delta(finished=True))
    return d, deltas


@pytest.mark.parametrize("tok_fixture", ["tiny_tok_dir", "byte_tok_dir"])
def test_joined_deltas_equal_full_decode(tok_fixture, request):
    tok = Tokenizer(request.getfixturevalue(tok_fixture))
    prompt = tok.encode("Hello:")
    out = tok.encode(TEXT, add_special_tokens=False)
    d, deltas = stream(tok, prompt, out)
    assert "".join(deltas) == tok.decode(out) == TEXT
    assert d.output_text == TEXT
    assert not any("\ufffd" in x for x in deltas)


def test_split_multibyte_characters_wait_for_their_last_byte(byte_tok_dir):
    tok = Tokenizer(byte_tok_dir)
    out = tok.encode("a🙂b", add_special_tokens=False)
    assert len(out) == 6  # a, 4 bytes of the emoji, b
    d, deltas = stream(tok, tok.encode("x"), out)
    assert deltas[:6] == ["a", "", "", "", "🙂", "b"]


def test_incomplete_character_at_the_end_is_dropped(byte_tok_dir):
    tok = Tokenizer(byte_tok_dir)
    out = tok.encode("ok東", add_special_tokens=False)[:-1]  # the last byte of 東 never comes
    d, deltas = stream(tok, tok.encode("x"), out)
    assert "".join(deltas) == "ok"


def test_special_tokens_skipped(tiny_tok_dir):
    tok = Tokenizer(tiny_tok_dir)
    out = tok.encode("Paris.", add_special_tokens=False) + [tok.eos_token_id]
    _, deltas = stream(tok, tok.encode("x"), out)
    assert "".join(deltas) == "Paris."
    _, deltas = stream(tok, tok.encode("x"), out, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == "Paris.</s>"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(byte_tok_dir, include):
    tok = Tokenizer(byte_tok_dir)
    text = "the quick brown fox jumps over the lazy dog. never printed"
    out = tok.encode(text, add_special_tokens=False)   # one token per byte: the stop spans 8 tokens
    params = SamplingParams(stop=("lazy dog", "zzz"), include_stop_str_in_output=include)
    d = IncrementalDetokenizer(tok, tok.encode("x"), params)
    deltas, matched, used = [], None, 0
    for t in out:
        used += 1
        matched = d.update([t])
        if matched:
            break
        deltas.append(d.take_delta(finished=False))
        assert "lazy dog" not in "".join(deltas)
    deltas.append(d.take_delta(finished=True))
    assert matched == "lazy dog"
    assert used == text.index("lazy dog") + len("lazy dog")  # stopped on the token completing it
    want = "the quick brown fox jumps over the " + ("lazy dog" if include else "")
    assert d.output_text == want == "".join(deltas)


def test_stop_string_split_inside_a_multibyte_character(byte_tok_dir):
    tok = Tokenizer(byte_tok_dir)
    out = tok.encode("ab東京cd", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode("x"), SamplingParams(stop=("京",)))
    results = [d.update([t]) for t in out]
    assert results.index("京") == len("ab東".encode()) + 2  # on the third byte of 京
    assert d.output_text == "ab東"


def test_stop_terminated_token_not_detokenized(tiny_tok_dir):
    tok = Tokenizer(tiny_tok_dir)
    d = IncrementalDetokenizer(tok, tok.encode("x"), SamplingParams(stop_token_ids=(7,), skip_special_tokens=False))
    d.update(tok.encode("Paris", add_special_tokens=False))
    d.update([tok.token_to_id("<|im_end|>")], stop_terminated=True)
    assert d.output_text == "Paris"
