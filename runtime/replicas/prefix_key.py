"""What a request's prompt starts with, as the router sees it: chained hashes of its leading fixed-size chunks.

    "You are a terse assistant. Answer in one line.  ...user turn..."
     |<----- chunk 0 ----->|<----- chunk 1 ----->|<-- partial: not hashed -->
     h0 = H(chunk 0)        h1 = H(h0, chunk 1)

Two requests share h_i exactly when their first i+1 chunks are equal, as the engine's prefix cache shares a full
block only when every block before it is equal too. The chunks are characters of the request as sent (the
completion prompt, or the chat's tools and messages as JSON), not tokens: a replica's front needs no tokenizer and no
engine directory, and equal leading text gives equal leading tokens but for a token cut at the chunk's edge.
Knows nothing of Ray or of replicas; front.py, peers.py and affinity.py use the hashes.
"""
from __future__ import annotations

import hashlib
import json

CHUNK_CHARS = 64      # about one 16-token block of English text
MAX_CHUNKS = 64       # beyond the first 4096 characters a longer shared prefix changes no routing decision
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def prefix_hashes(path: str, body: bytes, chunk_chars: int = CHUNK_CHARS,
                  max_chunks: int = MAX_CHUNKS) -> tuple[int, ...]:
    """The chained hashes of the full leading chunks of a generation request's prompt; () for any other request,
    or a body that is not the JSON object a generation request is (the replica answers those 400)."""
    if path not in GENERATION_PATHS:
        return ()
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ()
    if not isinstance(request, dict):
        return ()
    text = _chat_text(request) if path.endswith("/chat/completions") else _completion_text(request.get("prompt"))
    return chunk_hashes(text, chunk_chars, max_chunks)


def chunk_hashes(text: str, chunk_chars: int = CHUNK_CHARS, max_chunks: int = MAX_CHUNKS) -> tuple[int, ...]:
    hashes, previous = [], b""
    for start in range(0, min(len(text) // chunk_chars, max_chunks) * chunk_chars, chunk_chars):
        previous = hashlib.blake2b(previous + text[start:start + chunk_chars].encode("utf-8", "surrogatepass"),
                                   digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "little"))
    return tuple(hashes)


def _chat_text(request: dict) -> str:
    """Tools first (chat templates render them into the system prompt), then the messages in order. JSON of a list
    is written left to right, so equal leading messages give equal leading text."""
    return json.dumps([request.get("tools"), request.get("messages")], sort_keys=True, ensure_ascii=False)


def _completion_text(prompt) -> str:
    """The first prompt (a batch's prompts each go to the same replica as the first): text as is, token ids as
    comma-separated numbers."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt) + ","
    return ""
