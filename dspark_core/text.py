"""Turning a user's text into prompt token ids the way every entry point does (chat template aware)."""

from __future__ import annotations

from .errors import InvalidArgument


def encode_prompt(tokenizer, prompt: str, raw: bool = False) -> list[int]:
    """Token ids of `prompt`: wrapped as one user turn by the model's chat template unless `raw`."""
    if tokenizer is None:
        raise InvalidArgument("prompt", prompt[:40], "needs a tokenizer; this model has none, pass token ids")
    if not prompt or not prompt.strip():
        raise InvalidArgument("prompt", prompt, "must not be empty")
    if not raw and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)
