"""dasllama-server (llama-server's command line) and llama-server's native API, black-box on
loopback with httpx and the openai client, on SmolLM2."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

import dasllama as dl
from serverproc import start, stop

KEY = "sk-llama"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(smollm: dl.Model) -> Iterator[str]:
    # llama-server's flags, long and short, including ones dasllama takes and ignores (-ngl, -fa).
    proc, base = start(
        "-m", str(smollm.path), "-c", "1024", "-np", "2", "-t", "2", "--alias", "tiny,smol", "--tags", "chat,small",
        "-ctk", "f16", "-n", "48", "--temp", "0.8", "--seed", "42", "-ngl", "99", "-fa", "on", "--metrics", "--slots",
        "--api-key", KEY, "--cors-origins", "localhost",
        module="dasllama.serve.llama_server",
    )
    yield base
    assert stop(proc) == 0


def post(base: str, path: str, body: object, headers: dict[str, str] = AUTH) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=headers, timeout=120)


def test_unknown_and_unsupported_flags_are_named() -> None:
    for flags, needle in ((["--bogus-flag", "1"], "--bogus-flag"), (["--lora", "x.gguf"], "LoRA"), (["-ctk", "q4_9"], "-ctk q4_9")):
        r = subprocess.run([sys.executable, "-m", "dasllama.serve.llama_server", *flags], check=False, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and needle in r.stderr, r.stderr


def test_mmproj_flags_reach_the_server() -> None:
    from dasllama.serve.llama_server import translate

    args, _ = translate(["-m", "x.gguf", "-mm", "mmproj-x.gguf"])
    assert args.mmproj == ["mmproj-x.gguf"] and not args.no_mmproj
    args, _ = translate(["-m", "x.gguf", "--no-mmproj"])
    assert args.no_mmproj and not args.mmproj and not args.no_mmproj_offload
    args, _ = translate(["-m", "x.gguf", "--no-mmproj-offload"])
    assert args.no_mmproj_offload and not args.no_mmproj
    r = subprocess.run([sys.executable, "-m", "dasllama.serve.llama_server", "-m", "x.gguf", "-mmu", "https://example.com/p.gguf"], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--mmproj PATH" in r.stderr, r.stderr


def test_hf_repo_needs_a_local_file() -> None:
    r = subprocess.run([sys.executable, "-m", "dasllama.serve.llama_server", "-hf", "ggml-org/models"], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "does not download" in r.stderr


def test_completion_native_fields(server: str) -> None:
    body = {"prompt": "I believe the meaning of life is", "n_predict": 8, "return_tokens": True, "temperature": 0}
    r = post(server, "/completion", body)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["stop"] is True and j["stop_type"] == "limit" and j["tokens_predicted"] == 8 and len(j["tokens"]) == 8
    assert j["timings"]["predicted_n"] == 8 and j["timings"]["prompt_n"] + j["timings"]["cache_n"] == j["tokens_evaluated"]
    assert j["generation_settings"]["n_predict"] == 8 and j["generation_settings"]["seed"] == 42 and isinstance(j["has_new_line"], bool)
    # The tokens it returned decode to its content, and the same prompt as token ids gives the same.
    assert post(server, "/detokenize", {"tokens": j["tokens"]}).json()["content"] == j["content"]
    ids = post(server, "/tokenize", {"content": body["prompt"], "add_special": True}).json()["tokens"]
    assert post(server, "/completion", body | {"prompt": ids}).json()["content"] == j["content"]
    # Several prompts (ids, text, an object prompt) answer as a list; /completions is the same route.
    many = post(server, "/completions", body | {"prompt": [ids, body["prompt"], {"prompt_string": body["prompt"]}]}).json()
    assert [x["content"] for x in many] == [j["content"]] * 3


def test_completion_stream_matches_whole(server: str) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 12, "seed": 7}
    whole = post(server, "/completion", body).json()["content"]
    text, final = "", None
    with httpx.stream("POST", server + "/completion", json=body | {"stream": True}, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                if ev["stop"]:
                    final = ev
                else:
                    assert len(ev["tokens"]) == 1
                    text += ev["content"]
    assert text == whole and final is not None and final["timings"]["predicted_n"] == 12


def test_n_probs_and_grammar(server: str) -> None:
    j = post(server, "/completion", {"prompt": "The sky is", "n_probs": 3, "n_predict": 4, "temperature": 0}).json()
    probs = j["completion_probabilities"]
    assert len(probs) == 4 and all(len(p["top_logprobs"]) == 3 and p["logprob"] <= 0 for p in probs)
    assert probs[0]["id"] == probs[0]["top_logprobs"][0]["id"]  # greedy: the likeliest token
    g = post(server, "/completion", {"prompt": "Answer yes or no:", "grammar": 'root ::= ("yes" | "no") "."', "n_predict": 8}).json()
    assert g["content"] in ("yes.", "no.")
    js = post(server, "/completion", {"prompt": "A number:", "json_schema": {"type": "integer"}, "n_predict": 6}).json()
    int(js["content"])
    bad = post(server, "/completion", {"prompt": "x", "grammar": "root ::= (unclosed"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error" and bad.json()["error"]["code"] == 400


def test_bad_input_gets_llama_errors_and_server_lives(server: str) -> None:
    cases = [
        ("/completion", {"n_predict": 4}),
        ("/completion", {"prompt": 12}),
        ("/completion", {"prompt": [10**9]}),
        ("/completion", {"prompt": "x", "n_predict": "many"}),
        ("/completion", {"prompt": "x", "logit_bias": [[1]]}),
        ("/completion", {"prompt": {"prompt_string": "x", "multimodal_data": ["AAAA"]}}),
        ("/completion", {"prompt": "x " * 1100}),
        ("/tokenize", {"content": 5}),
        ("/detokenize", {"tokens": ["a"]}),
        ("/apply-template", {"messages": "hi"}),
        ("/infill", {"input_prefix": "def f(", "input_suffix": ""}),  # SmolLM2 has no FIM tokens
        ("/embeddings", {}),
    ]
    for path, body in cases:
        r = post(server, path, body)
        assert 400 <= r.status_code < 502, (path, body, r.text)
        err = r.json()["error"]
        assert err["code"] == r.status_code and isinstance(err["message"], str) and err["type"], (path, body, err)
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def test_tokenize_pieces_and_special(server: str, smollm: dl.Model) -> None:
    r = post(server, "/tokenize", {"content": "Hi 媽 🤗", "with_pieces": True}).json()["tokens"]
    assert [t["id"] for t in r] == dl.encode(smollm, "Hi 媽 🤗")
    assert all(isinstance(t["piece"], (str, list)) and len(t["piece"]) > 0 for t in r)
    # add_special adds what the file asks for: SmolLM2 asks for no BOS.
    assert post(server, "/tokenize", {"content": "Hi", "add_special": True}).json()["tokens"] == dl.encode(smollm, "Hi")


def test_apply_template_props_slots_models(server: str, smollm: dl.Model) -> None:
    msgs = [{"role": "user", "content": "Hello"}]
    prompt = post(server, "/apply-template", {"messages": msgs}).json()["prompt"]
    assert prompt == dl.render_chat(smollm, msgs)
    assert not post(server, "/apply-template", {"messages": msgs, "add_generation_prompt": False}).json()["prompt"].endswith("<|im_start|>assistant\n")
    props = httpx.get(server + "/props", headers=AUTH).json()
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 512 and props["model_path"].endswith(".gguf")
    assert props["default_generation_settings"]["params"]["seed"] == 42
    slots = httpx.get(server + "/slots", headers=AUTH).json()
    assert len(slots) == 2 and not any(s["is_processing"] for s in slots)
    assert post(server, "/slots/0?action=save", {"filename": "x.bin"}).status_code == 501
    models = httpx.get(server + "/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in models] == ["smol"] and set(models[0]["aliases"]) == {"smol", "tiny"} and set(models[0]["tags"]) == {"chat", "small"}


def test_cors_as_llama_server(server: str) -> None:
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
    ok = httpx.options(server + "/completions", headers={"Origin": "http://localhost:3000", **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000" and ok.headers["access-control-allow-credentials"] == "true"
    no = httpx.options(server + "/completions", headers={"Origin": "http://localhost.evil.com", **pre})
    assert no.status_code == 200 and "access-control-allow-origin" not in no.headers


def test_openai_client_without_v1_and_any_model_name(server: str) -> None:
    client = openai.OpenAI(base_url=server, api_key=KEY)  # llama-server's routes need no /v1
    r = client.chat.completions.create(model="gpt-3.5-turbo", messages=[{"role": "user", "content": "Hi"}], max_tokens=6)
    assert r.choices[0].message.content and r.model == "smol"
    v1 = openai.OpenAI(base_url=server + "/v1", api_key=KEY)
    c = v1.completions.create(model="gpt-3.5-turbo-instruct", prompt="I believe the meaning of life is", max_tokens=8)
    assert c.choices[0].finish_reason == "length" and c.system_fingerprint and c.system_fingerprint.startswith("b")
    # The first streamed chunk carries the role and no content (llama-server's shape).
    chunks = list(v1.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    assert chunks[-1].usage is not None  # llama-server streams usage by default
    e = v1.embeddings.create(model="x", input=["hello", "world"])
    assert len(e.data) == 2 and len(e.data[0].embedding) == int(dl.load_model(dl.fetch("smollm2-135m-instruct")).config["dim"])


def test_embedding_input_forms(server: str) -> None:
    forms = ["", "text", [12, 34, 56], [12, 34, "text", 56], {"prompt_string": "text"}, {"content": [{"type": "text", "text": "te"}, {"type": "text", "text": "xt"}]}]
    for f in forms:
        r = post(server, "/v1/embeddings", {"input": f})
        assert r.status_code == 200 and len(r.json()["data"]) == 1, (f, r.text)
    many = post(server, "/v1/embeddings", {"input": ["text", [12, 34], {"prompt_string": "text"}]}).json()["data"]
    assert len(many) == 3 and many[0]["embedding"] == many[2]["embedding"]
    native = post(server, "/embedding", {"content": "text"}).json()
    assert native[0]["index"] == 0 and native[0]["embedding"][0] == many[0]["embedding"]


def test_api_key_header_forms(server: str) -> None:
    body = {"prompt": "Hi", "n_predict": 2}
    assert post(server, "/completion", body, headers={}).json()["error"]["type"] == "authentication_error"
    assert post(server, "/completion", body, headers={"X-Api-Key": KEY}).status_code == 200


def test_rerank_by_embedding_similarity(server: str, smollm: dl.Model) -> None:
    docs = ["Paris is the capital of France.", "Machine learning is a field of artificial intelligence.", "Bananas are yellow."]
    r = post(server, "/rerank", {"query": "What is machine learning?", "documents": docs, "top_n": 2}).json()
    assert r["scoring"] == "embedding_similarity" and len(r["results"]) == 2
    v = dl.embed(smollm, ["What is machine learning?", *docs])
    want = sorted(range(3), key=lambda i: -float(v[i + 1] @ v[0]))[:2]
    assert [x["index"] for x in r["results"]] == want
    tei = post(server, "/v1/rerank", {"query": "What is machine learning?", "texts": docs}).json()
    assert [x["index"] for x in tei][:2] == want
    for bad in ({"query": "q", "documents": []}, {"query": "q", "documents": [1, 2]}, {"query": "q"}, {"documents": ["a"]}):
        assert post(server, "/rerank", bad).status_code == 400


def test_predict_instances(server: str) -> None:
    body = {"instances": [{"@requestFormat": "chatCompletions", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}, {"@requestFormat": "completions", "max_tokens": 3, "prompt": "The sky"}]}
    p = post(server, "/predict", body).json()["predictions"]
    assert p[0]["object"] == "chat.completion" and p[1]["object"] == "text_completion"
    assert post(server, "/predict", {"instances": [{"@requestFormat": "nope"}]}).status_code == 400


def test_metrics_llama_names_and_switch(server: str) -> None:
    post(server, "/completion", {"prompt": "Hello", "n_predict": 3})
    r = httpx.get(server + "/metrics", headers=AUTH)
    # Written as llama-server writes it: clients that read headers into a plain dict look it up so.
    assert r.status_code == 200 and b"Process-Start-Time-Unix" in [k for k, _ in r.headers.raw]
    values = {ln.split()[0]: float(ln.split()[1]) for ln in r.text.splitlines() if ln.startswith("llamacpp:")}
    assert values["llamacpp:tokens_predicted_total"] >= 3 and values["llamacpp:n_decode_total"] > 0 and values["llamacpp:requests_processing"] == 0
