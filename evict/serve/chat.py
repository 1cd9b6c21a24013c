"""Chat templates and the end-of-text token.

A model folder's chat template is, in order: the file given by `evict serve --chat-template FILE`; the folder's
`chat_template.jinja`; the "chat_template" string of its `tokenizer_config.json` (Hugging Face's places); else
DEFAULT_CHAT_TEMPLATE. A template is Jinja (sandboxed), rendered with `messages` (role, content, name),
`add_generation_prompt` (True), `bos_token` ("") and `eos_token` (the end-of-text token's text, or "")."""

from __future__ import annotations

import json
from pathlib import Path

from evict.cli_args import first_line

DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
EOS_NAMES = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "</s>", "<eos>", "<|end|>")


def find_chat_template(folder: Path | None, path: str | None = None) -> str:
    """The template text (see the module's docstring); a missing or unreadable file is a one-line ValueError."""
    if path is not None:
        try:
            return Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {path} ({e})") from None
    if folder is not None and (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if folder is not None and (folder / "tokenizer_config.json").is_file():
        try:
            template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
        except (ValueError, AttributeError):
            template = None
        if isinstance(template, str):
            return template
    return DEFAULT_CHAT_TEMPLATE


class ChatTemplate:
    def __init__(self, source: str, eos_text: str = ""):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            self.template = ImmutableSandboxedEnvironment(keep_trailing_newline=True).from_string(source)
        except TemplateError as e:
            raise ValueError(f"--chat-template: not a Jinja template ({e})") from None
        self.eos_text = eos_text

    def render(self, messages: list[dict]) -> str:
        """ValueError (one line) when the template fails on these messages (e.g. it raises on a role order)."""
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token="",
                                        eos_token=self.eos_text)
        except (TemplateError, TypeError, ValueError) as e:
            raise ValueError(f"the chat template failed on them ({first_line(e)})") from None


def eos_token_id(tokenizer) -> int | None:
    """The tokenizer's end-of-text id: its `eos_id` / `eos_token_id` attribute, else an added special token of a
    well-known name (<|endoftext|>, </s>, ...), else None (generation then ends at max_tokens or a stop)."""
    for attr in ("eos_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    hf = getattr(tokenizer, "_tok", None)
    if hf is not None:
        for name in EOS_NAMES:
            i = hf.token_to_id(name)
            if i is not None:
                return int(i)
    return None
