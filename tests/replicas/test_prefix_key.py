"""prefix_key: requests share leading hashes exactly when they share leading full chunks of their prompt."""
from __future__ import annotations

import json

from engine.runtime.replicas.prefix_key import chunk_hashes, prefix_hashes

SYSTEM = "You are a terse assistant for a hardware store. Answer in one line, name the aisle. " * 2


def chat(system: str, user: str, **extra) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "system", "content": system},
                                                  {"role": "user", "content": user}], **extra}).encode()


def test_chat_requests_with_one_system_prompt_share_its_chunks_and_differ_after():
    a = prefix_hashes("/v1/chat/completions", chat(SYSTEM, "Where are the hinges?"))
    b = prefix_hashes("/v1/chat/completions", chat(SYSTEM, "Do you sell paint by the litre?"))
    shared = len(SYSTEM) // 64
    assert len(a) >= shared and a[:shared] == b[:shared]
    assert a != b
    other = prefix_hashes("/v1/chat/completions", chat("Another system prompt. " * 8, "Where are the hinges?"))
    assert other[0] != a[0]


def test_sampling_fields_do_not_change_the_prefix_but_tools_do():
    base = prefix_hashes("/v1/chat/completions", chat(SYSTEM, "hi"))
    assert prefix_hashes("/v1/chat/completions", chat(SYSTEM, "hi", temperature=0.7, max_tokens=9)) == base
    tools = [{"type": "function", "function": {"name": "find_aisle", "parameters": {"type": "object"}}}]
    assert prefix_hashes("/v1/chat/completions", chat(SYSTEM, "hi", tools=tools))[0] != base[0]


def test_completion_prompts_text_token_ids_and_batches():
    text = "x" * 200
    assert prefix_hashes("/v1/completions", json.dumps({"prompt": text}).encode()) == chunk_hashes(text)
    assert prefix_hashes("/v1/completions", json.dumps({"prompt": [text, "y"]}).encode()) == chunk_hashes(text)
    ids = list(range(100))
    a = prefix_hashes("/v1/completions", json.dumps({"prompt": ids}).encode())
    b = prefix_hashes("/v1/completions", json.dumps({"prompt": [ids[:60] + [7] * 40]}).encode())
    assert a and a[0] == b[0]


def test_only_full_chunks_count_and_the_count_is_capped():
    assert chunk_hashes("a" * 63) == ()
    assert len(chunk_hashes("a" * 128)) == 2
    assert len(chunk_hashes("a" * 100_000)) == 64


def test_other_paths_and_bodies_that_are_not_requests_have_no_prefix():
    assert prefix_hashes("/tokenize", json.dumps({"prompt": "x" * 200}).encode()) == ()
    assert prefix_hashes("/v1/completions", b"not json") == ()
    assert prefix_hashes("/v1/completions", b"[1, 2]") == ()
    assert prefix_hashes("/v1/completions", b"\xff\xfe") == ()
