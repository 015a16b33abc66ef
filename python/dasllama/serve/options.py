"""Server-wide options beyond the OpenAI API's: what llama-server's command line sets
(`dasllama-server`, llama_server.py) and the native, Anthropic and Ollama routes read. Plain
`python -m dasllama.serve` leaves them at their defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

# llama-server downloads --hf-repo models; dasllama-server (and its router) serve this local file
# (or dasllama model name) in their place.
HF_FALLBACK_ENV = "DASLLAMA_SERVER_HF_FALLBACK"


@dataclass
class Options:
    # Request defaults where a request names none (llama-server's --n-predict, --temp, --seed).
    n_predict: int = -1  # -1: until the context is full or the model stops
    temperature: float | None = None
    seed: int | None = None
    # Per-slot context as llama-server reports it (-c divided among -np slots); 0: the model's.
    n_ctx_slot: int = 0
    slots_endpoint: bool = True  # GET /slots (llama-server: --slots / --no-slots)
    metrics_endpoint: bool = True  # GET /metrics (llama-server: --metrics)
    ui: bool = True  # the chat page at / (llama-server: --no-ui)
    embeddings: bool = True  # /embedding(s) (llama-server needs --embedding; dasllama always serves them)
    aliases: list[str] = field(default_factory=list)  # --alias a,b,c: every name /models lists
    tags: list[str] = field(default_factory=list)  # --tags
    # CORS as llama-server answers it: the caller's origin echoed back with credentials allowed;
    # "localhost" stands for any loopback origin. None: dasllama.serve's own --cors-origin rules.
    llama_cors: list[str] | None = None
    build: str = "b0-dasllama"
    notes: list[str] = field(default_factory=list)  # what the command line mapped or ignored, logged at start
    # llama-server's answers where they differ from OpenAI's: chat streams end with a usage chunk
    # unless stream_options says no, a context overflow is an "exceed_context_size_error".
    llama_compat: bool = False
    verbose: bool = False  # every answer carries __verbose (llama-server's --verbose); a request's "verbose" too
    pooling: str | None = None  # --pooling for the embeddings routes (None: the model's own)
    reasoning: str | None = None  # --reasoning on/off/auto: "off" renders templates with thinking off
    slot_save_path: str | None = None  # --slot-save-path: POST /slots/N?action=save|restore|erase (slots.py)
    # Remote image URLs in image_url parts: refused unless --allow-image-urls; then fetched with
    # llama-server's limits (10 MiB, 10 s) unless --image-url-max-bytes / --image-url-timeout say.
    image_urls: bool = False
    image_url_max_bytes: int = 10 * 1024 * 1024
    image_url_timeout_s: float = 10.0
    chat_template: str | None = None  # --chat-template-file: used instead of the model's template  # system_fingerprint, as llama-server's "b<build>"


FINGERPRINT = Options.build
