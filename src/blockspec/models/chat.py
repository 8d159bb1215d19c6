"""Prompt text -> token ids, through the model's chat template when it has one."""

from __future__ import annotations


def encode_prompt(tokenizer, text: str, *, chat: bool = True) -> list[int]:
    """Token ids of ``text``; with ``chat`` and a tokenizer that has a chat template, ``text`` is sent as the
    user's message and the assistant's turn is opened (the template adds its own special tokens)."""
    if chat and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return tokenizer(text, add_special_tokens=True)["input_ids"]
