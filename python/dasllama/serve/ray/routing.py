"""Prefix keys for routing, with no Ray and no model: the ingress computes them from the request body
alone (it holds no tokenizer: on a real cluster it may run on a node without the model file).

A prompt's key is a hash chain over fixed-size chunks of its text, the way the engine's prefix cache
keys full KV pages by a hash chain over their tokens: two prompts share the first n links exactly
when they share their first n chunks, so the replica that served the longest matching chain is the
one holding the most of this prompt's pages. The text of a chat request is its messages in order
(role and content, with separators), which grows the same way as the rendered template does: a later
turn of a conversation, or another question under the same system turn, extends the earlier text.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Characters per chunk: English runs at about 4 characters a token, so one chunk is about one KV page
# of the default --page-rows 16.
CHUNK_CHARS = 64
# Links hashed at most: past 16 KiB of shared text, which replica holds more of it hardly matters.
MAX_LINKS = 256


def prompt_text(body: Any, chat: bool) -> str | None:
    """The text a request's prompt is made of, in the order the model reads it; None when the body
    holds no prompt this can read (the replica answers such a request with its 400)."""
    if not isinstance(body, dict):
        return None
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return None
        parts = []
        for msg in msgs:
            if not isinstance(msg, dict):
                return None
            content = msg.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            # The record separator keeps "ab"+"c" apart from "a"+"bc".
            parts.append(f"{msg.get('role')}\x1f{content if isinstance(content, str) else ''}\x1e")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        # Token ids: each as a fixed-width piece, so chunk boundaries fall on whole tokens.
        return "".join(f"{t:08x}" for t in prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]  # a list of prompts: the first stands for the batch
    return None


def prefix_chain(body: Any, chat: bool, chunk_chars: int = CHUNK_CHARS, max_links: int = MAX_LINKS) -> list[str]:
    """Hash chain over the prompt's full chunks: link i names chunks 0..i. Seeded with the model's
    name, so two models' equal prompts never share a key."""
    text = prompt_text(body, chat)
    if text is None:
        return []
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    h = hashlib.blake2b(json.dumps([model, chat]).encode(), digest_size=8).digest()
    links = []
    for i in range(min(len(text) // chunk_chars, max_links)):
        h = hashlib.blake2b(h + text[i * chunk_chars : (i + 1) * chunk_chars].encode("utf-8", "surrogatepass"), digest_size=8).digest()
        links.append(h.hex())
    return links


def rendezvous(key: str, replica: str) -> int:
    """A score that every router agrees on for (key, replica): the highest wins, so ingresses that
    have never seen a prefix still send it to the same replica."""
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica}".encode(), digest_size=8).digest(), "big")
