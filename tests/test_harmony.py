"""Harmony, gpt-oss's chat format, with gpt-oss's own chat template
(tests/golden/gpt_oss_chat_template.jinja, llama.cpp's models/templates/openai-gpt-oss-120b.jinja)
in scripted synthetic files: the template renders `reasoning_effort`; the loader reads the
format's tokens as llama.cpp does (the structural ones shown as text, `<|return|>` and `<|call|>`
end a reply, `<|end|>` does not); the splitter sends the analysis and commentary channels to
reasoning and the final channel to content, piece by piece; and the server answers with
`reasoning_content` and `content`, streamed or not, stopping at `<|return|>` and `<|call|>`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import dasllama as dl
from dasllama.chat import HARMONY_MARKERS, thought_markers
from serverproc import start, stop
from synthetic import write_scripted_model

TEMPLATE = (Path(__file__).parent / "golden" / "gpt_oss_chat_template.jinja").read_text()
SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]
WORDS = ("analysis", "final", "commentary", "assistant")
# The generation prompt ends "<|start|>assistant", whose last token here is the piece "t".
# A model that reasons and goes on reasoning (the scripted models have no memory, so its second
# message opens the analysis channel again) until max_tokens cuts it.
REASONS = {
    "t": "<|channel|>",
    "<|channel|>": "analysis",
    "analysis": "<|message|>",
    "<|message|>": "\u2581the",
    "\u2581the": "<|end|>",
    "<|end|>": "<|start|>",
    "<|start|>": "assistant",
    "assistant": "<|channel|>",
}
# A model that answers on the final channel at once and returns.
ANSWERS = {"t": "<|channel|>", "<|channel|>": "final", "final": "<|message|>", "<|message|>": "\u2581cat", "\u2581cat": "at", "at": "<|return|>"}
# A model that calls a tool on the commentary channel.
CALLS = {"t": "<|channel|>", "<|channel|>": "commentary", "commentary": "<|message|>", "<|message|>": "\u2581a", "\u2581a": "<|call|>"}
MSGS = [{"role": "user", "content": "hi"}]


def write(path: Path, script: dict[str, str]) -> dl.Model:
    write_scripted_model(path, SPECIALS, script, TEMPLATE, pieces=WORDS, ctx=1024)
    return dl.load_model(path)


def test_the_template_renders_reasoning_effort_and_the_loader_reads_harmony_tokens(tmp_path: Path) -> None:
    m = write(tmp_path / "h.gguf", ANSWERS)
    for effort in ("low", "high"):
        text = dl.render_chat(m, MSGS, reasoning_effort=effort)
        assert f"\nReasoning: {effort}\n" in text and text.endswith("<|start|>user<|message|>hi<|end|><|start|>assistant"), text
    assert "\nReasoning: medium\n" in dl.render_chat(m, MSGS)  # the template's own default
    ids = dl.encode(m, dl.render_chat(m, MSGS), special=True)
    assert m._native.token_text(ids[-1]) == "t"  # what the scripts continue from
    # llama.cpp's reading of an o200k_harmony vocabulary: <|end|> closes a message, not the reply.
    tok = {t: dl.encode(m, t, add_bos=False, special=True)[0] for t in SPECIALS}
    assert sorted(m.eog_ids) == sorted([2, tok["<|return|>"], tok["<|call|>"]])
    # The structural tokens are shown as text (so a reply's channels can be read), the ends not.
    assert dl.decode(m, [tok["<|channel|>"], tok["<|message|>"], tok["<|start|>"], tok["<|end|>"]]) == "<|channel|><|message|><|start|>"
    assert thought_markers(m) == HARMONY_MARKERS
    # Harmony has no thinking-off form: no nothink guard, whatever set_thinking says.
    chat = dl.create_chat_renderer(m)
    dl.set_thinking(chat, False)
    assert dl.make_nothink_guard(chat) is None


REPLY = "<|channel|>analysis<|message|>Weigh it: 2 < 3.<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|start|>assistant<|channel|>final<|message|>Yes, 2 < 3."


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_splitter_sends_channels_to_reasoning_and_content_piece_by_piece(size: int) -> None:
    sp = dl.thought_splitter(HARMONY_MARKERS)
    assert isinstance(sp, dl.HarmonySplitter)
    reasoning, content, order = "", "", []
    for i in range(0, len(REPLY), size):
        r, c = sp.feed(REPLY[i : i + size])
        reasoning, content = reasoning + r, content + c
        order += ["r"] * bool(r) + ["c"] * bool(c)
    r, c = sp.finish()
    reasoning, content = reasoning + r, content + c
    # Headers are neither; analysis and commentary are reasoning; nothing of a marker leaks.
    assert (reasoning, content) == ("Weigh it: 2 < 3.{}", "Yes, 2 < 3."), (size, reasoning, content)
    assert order == sorted(order, key=lambda k: k != "r"), order


def test_split_reasoning_edge_cases() -> None:
    h = HARMONY_MARKERS
    # Cut off while reasoning: all reasoning. A reply with no header: all content.
    assert dl.split_reasoning("<|channel|>analysis<|message|>hmm, what if", h) == ("hmm, what if", "")
    assert dl.split_reasoning("  plain words", h) == ("", "  plain words")
    # The prompt opened the analysis channel; an end token (shown in a special decode) ends a body.
    assert dl.split_reasoning("so<|end|><|start|>assistant<|channel|>final<|message|>ok<|return|>", h, in_thought=True) == ("so", "ok")
    # A header cut off mid-way is markup, not text.
    assert dl.split_reasoning("<|channel|>analysis<|message|>a<|start|>assistant<|chan", h) == ("a", "")
    # Qwen's markers still split as before.
    assert dl.split_reasoning("<think>x</think>\n\ny") == ("x", "y")


# --- through the real HTTP server ---


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, dl.Model]]]:
    d = tmp_path_factory.mktemp("harmony-server")
    models = {name: write(d / f"{name}.gguf", script) for name, script in (("reasons", REASONS), ("answers", ANSWERS), ("calls", CALLS))}
    args = [a for name in models for a in ("--model", str(d / f"{name}.gguf"), "--alias", name)]
    proc, base = start(*args, "--streams", "2")
    yield base, models
    assert stop(proc) == 0


def chat(base: str, model: str, **extra: object) -> dict:
    r = httpx.post(base + "/v1/chat/completions", json={"model": model, "messages": MSGS, "max_tokens": 12, "temperature": 0, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(base: str, model: str, **extra: object) -> tuple[str, str, str]:
    body = {"model": model, "messages": MSGS, "max_tokens": 12, "temperature": 0, "stream": True, **extra}
    reasoning, content, finish = "", "", ""
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"][0]
            reasoning += ch["delta"].get("reasoning_content") or ""
            content += ch["delta"].get("content") or ""
            finish = ch["finish_reason"] or finish
    return reasoning, content, finish


def test_server_splits_the_analysis_channel_into_reasoning_content(server: tuple[str, dict[str, dl.Model]]) -> None:
    base, _ = server
    # Past <|end|> (not an end of the reply): message after message of analysis, until max_tokens.
    r = chat(base, "reasons")
    msg, finish = r["choices"][0]["message"], r["choices"][0]["finish_reason"]
    assert (msg["reasoning_content"], msg["content"], finish) == (" the" * 2, "", "length"), r
    assert chat_stream(base, "reasons") == (" the" * 2, "", "length")


def test_server_returns_the_final_channel_as_content_and_stops_at_return(server: tuple[str, dict[str, dl.Model]]) -> None:
    base, _ = server
    r = chat(base, "answers")
    msg = r["choices"][0]["message"]
    assert (msg["content"], r["choices"][0]["finish_reason"]) == (" catat", "stop"), r
    assert "reasoning_content" not in msg
    assert chat_stream(base, "answers") == ("", " catat", "stop")
    # <|call|> ends a reply too; the commentary channel is not content.
    r = chat(base, "calls")
    assert (r["choices"][0]["message"].get("reasoning_content"), r["choices"][0]["finish_reason"]) == (" a", "stop"), r
    assert chat_stream(base, "calls") == (" a", "", "stop")


def test_server_passes_reasoning_effort_to_the_template(server: tuple[str, dict[str, dl.Model]]) -> None:
    base, models = server
    m = models["answers"]

    def tokens(**kw: str) -> int:
        return len(dl.encode(m, dl.render_chat(m, MSGS, **kw), special=True))

    # "high" is one letter longer than "low" here (a byte-level vocabulary): the prompt shows it.
    assert tokens(reasoning_effort="high") == tokens(reasoning_effort="low") + 1
    for effort in ("low", "medium", "high"):
        assert chat(base, "answers", reasoning_effort=effort)["usage"]["prompt_tokens"] == tokens(reasoning_effort=effort)
    assert chat(base, "answers")["usage"]["prompt_tokens"] == tokens(reasoning_effort="medium")


@pytest.mark.parametrize("effort", ["none", "minimal", "extreme", 3])
def test_server_rejects_a_reasoning_effort_harmony_does_not_take(server: tuple[str, dict[str, dl.Model]], effort: object) -> None:
    base, _ = server
    r = httpx.post(base + "/v1/chat/completions", json={"model": "answers", "messages": MSGS, "reasoning_effort": effort}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    assert "low, medium, high" in r.json()["error"]["message"], r.text
