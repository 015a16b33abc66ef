"""llama.cpp's built-in chat formats by name, for `dasllama-server --chat-template NAME`
(llama.cpp's src/llama-chat.cpp writes them in C++; here each is the Jinja template that renders
the same text). A value that names none is taken as a Jinja template itself, as llama-server
takes it."""

from __future__ import annotations

_GEN = "{%- if add_generation_prompt %}{{- '%s' }}{%- endif %}"


def _simple(turn: str, gen: str) -> str:
    """Every message as `turn` (Jinja, over `m`), then `gen` when a reply is asked for."""
    return "{%- for m in messages %}" + turn + "{%- endfor %}" + _GEN.replace("%s", gen)


NAMED: dict[str, str] = {
    "chatml": _simple("{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}", "<|im_start|>assistant\\n"),
    "llama3": _simple("{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content | trim) + '<|eot_id|>' }}", "<|start_header_id|>assistant<|end_header_id|>\\n\\n"),
    "command-r": _simple(
        "{%- set tok = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>', 'assistant': '<|CHATBOT_TOKEN|>'} %}"
        "{%- if m.role in tok %}{{- '<|START_OF_TURN_TOKEN|>' + tok[m.role] + (m.content | trim) + '<|END_OF_TURN_TOKEN|>' }}{%- endif %}",
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    ),
    "phi3": _simple("{{- '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}", "<|assistant|>\\n"),
    "phi4": _simple("{{- '<|im_start|>' + m.role + '<|im_sep|>' + m.content + '<|im_end|>' }}", "<|im_start|>assistant<|im_sep|>"),
    "zephyr": _simple("{{- '<|' + m.role + '|>\\n' + m.content + '<|endoftext|>\\n' }}", "<|assistant|>\\n"),
    "mistral-v7": _simple(
        "{%- if m.role == 'system' %}{{- '[SYSTEM_PROMPT] ' + m.content + '[/SYSTEM_PROMPT]' }}"
        "{%- elif m.role == 'user' %}{{- '[INST] ' + m.content + '[/INST]' }}{%- else %}{{- ' ' + m.content + '</s>' }}{%- endif %}",
        "",
    ),
    "mistral-v7-tekken": _simple(
        "{%- if m.role == 'system' %}{{- '[SYSTEM_PROMPT]' + m.content + '[/SYSTEM_PROMPT]' }}"
        "{%- elif m.role == 'user' %}{{- '[INST]' + m.content + '[/INST]' }}{%- else %}{{- m.content + '</s>' }}{%- endif %}",
        "",
    ),
    "vicuna": _simple(
        "{%- if m.role == 'system' %}{{- m.content + '\\n\\n' }}{%- elif m.role == 'user' %}{{- 'USER: ' + m.content + '\\n' }}"
        "{%- elif m.role == 'assistant' %}{{- 'ASSISTANT: ' + m.content + '</s>\\n' }}{%- endif %}",
        "ASSISTANT:",
    ),
    "vicuna-orca": _simple(
        "{%- if m.role == 'system' %}{{- 'SYSTEM: ' + m.content + '\\n' }}{%- elif m.role == 'user' %}{{- 'USER: ' + m.content + '\\n' }}"
        "{%- elif m.role == 'assistant' %}{{- 'ASSISTANT: ' + m.content + '</s>\\n' }}{%- endif %}",
        "ASSISTANT:",
    ),
    "deepseek": _simple(
        "{%- if m.role == 'system' %}{{- m.content }}{%- elif m.role == 'user' %}{{- '### Instruction:\\n' + m.content + '\\n' }}"
        "{%- elif m.role == 'assistant' %}{{- '### Response:\\n' + m.content + '\\n<|EOT|>\\n' }}{%- endif %}",
        "### Response:\\n",
    ),
    "deepseek3": _simple(
        "{%- if m.role == 'system' %}{{- m.content + '\\n\\n' }}{%- elif m.role == 'user' %}{{- '<\uff5cUser\uff5c>' + m.content }}"
        "{%- elif m.role == 'assistant' %}{{- '<\uff5cAssistant\uff5c>' + m.content + '<\uff5cend\u2581of\u2581sentence\uff5c>' }}{%- endif %}",
        "<\uff5cAssistant\uff5c>",
    ),
    # Gemma has no system turn: the system text opens the first user turn.
    "gemma": (
        "{%- set ns = namespace(sys='') %}{%- for m in messages %}"
        "{%- if m.role == 'system' %}{%- set ns.sys = ns.sys + (m.content | trim) %}"
        "{%- else %}{%- set role = 'model' if m.role == 'assistant' else m.role %}{{- '<start_of_turn>' + role + '\\n' }}"
        "{%- if ns.sys and role != 'model' %}{{- ns.sys + '\\n\\n' }}{%- set ns.sys = '' %}{%- endif %}"
        "{{- (m.content | trim) + '<end_of_turn>\\n' }}{%- endif %}{%- endfor %}" + _GEN.replace("%s", "<start_of_turn>model\\n")
    ),
}


def resolve(value: str) -> tuple[str, str]:
    """--chat-template's value -> (the Jinja template, what it was: "built-in NAME" or "given")."""
    if value in NAMED:
        return NAMED[value], f"llama.cpp's built-in '{value}'"
    return value, "given on the command line"
