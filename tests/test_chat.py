"""The chat renderer: the model's template to tokens, with no KV."""

from __future__ import annotations

import pytest

import dasllama as dl


def test_render_turn_matches_llama_cpp_prompts(smollm: dl.Model, smollm_golden: dict) -> None:
    for c in smollm_golden["cases"]:
        if c["kind"] != "chat":
            continue
        msgs = c["messages"]
        system = msgs[0]["content"] if msgs[0]["role"] == "system" else ""
        chat = dl.create_chat_renderer(smollm, system)
        for msg in msgs[1 if system else 0 :]:
            (dl.add_user if msg["role"] == "user" else dl.add_assistant)(chat, msg["content"])
        assert dl.render_turn(smollm, chat) == c["prompt_ids"]


def test_close_and_stop_ids(smollm: dl.Model) -> None:
    chat = dl.create_chat_renderer(smollm, "Be brief.")
    dl.add_user(chat, "Hi")
    close = dl.render_close(smollm, chat)
    assert dl.decode(smollm, close, special=True) == "<|im_end|>\n"
    assert close[0] in dl.turn_stop_ids(chat)
    first = dl.render_turn(smollm, chat)
    dl.add_assistant(chat, "Hello!")
    dl.add_user(chat, "Bye")
    second = dl.render_turn(smollm, chat)
    # The next turn extends the previous one: what a prefix cache can reuse.
    reply = dl.encode(smollm, "Hello!")
    assert second[: len(first) + len(reply) + len(close)] == first + reply + close
    assert dl.make_nothink_guard(chat) is None


def test_model_without_template(gemma: dl.Model) -> None:
    with pytest.raises(dl.TemplateError, match="no chat template"):
        dl.create_chat_renderer(gemma)


def test_scheduler_with_renderer(smollm: dl.Model) -> None:
    chat = dl.create_chat_renderer(smollm, "You are a concise assistant.", 32)
    dl.add_user(chat, "What is the capital of France?")
    req = dl.PendingReq(id=1, prompt=dl.render_turn(smollm, chat), close_toks=dl.render_close(smollm, chat), stop_ids=dl.turn_stop_ids(chat), max_new=32)
    sch = dl.create_scheduler(smollm)
    assert dl.submit(smollm, sch, req)
    evs: list[dl.SchedEvent] = []
    while dl.scheduler_step(smollm, sch, evs):
        pass
    text = "".join(e.text for e in evs if e.kind == "piece")
    fin = [e for e in evs if e.kind == "finished"]
    want = dl.generate(smollm, dl.create_session(smollm), req.prompt, dl.SamplingParams(), 32)
    assert len(fin) == 1 and fin[0].finish == ("stop" if want[-1] in req.stop_ids else "length")
    assert text == dl.decode(smollm, [t for t in want if t not in req.stop_ids])
    assert not any(e.token in req.stop_ids for e in evs if e.kind == "piece")


def test_serving_example_warm_round_attaches_cached_pages(smollm: dl.Model) -> None:
    """examples/13_serving.py: the warm round attaches >= 48 cached prompt tokens per stream."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "13_serving.py"
    spec = importlib.util.spec_from_file_location("serving_example", path)
    assert spec and spec.loader
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    sch = dl.create_scheduler(smollm, max_streams=4, page_rows=16)
    ex.run(smollm, ex.requests(smollm, 1, 8), 4, show=False, sch=sch)
    cached: list[int] = []
    for r in ex.requests(smollm, 11, 8, ex.WARM_QUESTIONS):
        dl.submit(smollm, sch, r)
    evs: list[dl.SchedEvent] = []
    while dl.scheduler_step(smollm, sch, evs):
        pass
    cached = [e.n_cached for e in evs if e.kind == "finished"]
    assert len(cached) == 4 and min(cached) >= 48, cached


# The generation prompt of Qwen3's template, as it ships.
QWEN3_GEN = """{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def test_set_thinking_renders_the_templates_switch(tmp_path) -> None:
    from synthetic import write_model

    p = tmp_path / "thinking.gguf"
    write_model(p)
    m = dl.load_model(p)
    m.chat_template = QWEN3_GEN
    chat = dl.create_chat_renderer(m)
    dl.add_user(chat, "hi")
    default = dl.decode(m, dl.render_turn(m, chat))
    assert default.endswith("<|im_start|>assistant\n"), default
    dl.set_thinking(chat, False)
    assert dl.decode(m, dl.render_turn(m, chat)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    dl.set_thinking(chat, True)
    assert dl.decode(m, dl.render_turn(m, chat)) == default
