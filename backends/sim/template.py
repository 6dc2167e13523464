"""The simulator's chat template (ChatML).

It is rendered by kvgate's Hugging Face compatible renderer (``index.chat_template``), the
same code ``kvgate serve`` uses, so the simulator and the gateway agree on every token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvgate.index.errors import TemplateError

CHAT_TEMPLATE = (
    "{%- macro render_text(content) -%}\n"
    "{%- if content is string -%}{{ content }}\n"
    "{%- elif content is iterable and content is not mapping -%}\n"
    "{{ content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\\n') }}\n"
    "{%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- if tools -%}\n"
    "<|im_start|>system\n"
    "# Tools\n"
    "{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n"
    "{% endif -%}\n"
    "{%- for message in messages -%}\n"
    "<|im_start|>{{ message['role'] }}\n"
    "{{ render_text(message['content']) }}\n"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}\n"
    "{{ '\\n' }}{% for call in message['tool_calls'] %}<tool_call>{{ call | tojson }}</tool_call>\n"
    "{% endfor -%}\n"
    "{%- endif -%}\n"
    "<|im_end|>\n"
    "{% endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "<|im_start|>assistant\n"
    "{% endif -%}\n"
)
"""ChatML: ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message, tools as a system block."""


def cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``continue_final_message``: drop what the template wrote after the final message.

    Same rule as ``transformers``' ``apply_chat_template``.
    """
    final = _final_text(messages)
    stripped = final.strip()
    if stripped not in text:
        raise TemplateError("continue_final_message: final message not found in the prompt")
    at = text.rindex(stripped)
    if text[at : at + len(final.lstrip())] == final:
        return text[: at + len(final.lstrip())]
    return text[: at + len(stripped)]


def _final_text(messages: Sequence[Mapping[str, Any]]) -> str:
    if not messages:
        raise TemplateError("continue_final_message needs at least one message")
    content = messages[-1].get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        for part in reversed(content):
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                return str(part["text"])
    raise TemplateError("continue_final_message: the final message has no text")
