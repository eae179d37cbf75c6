"""A chat turned into the prompt text a chat model was trained on: its tokenizer's chat template."""


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """The model's chat template applied to `messages` ({"role", "content"} dicts), ready for the assistant's
    answer. A tokenizer without a template (like the tests' tiny one) gets a plain fallback: one
    "role: content" line per message, then "assistant:"."""
    if not getattr(tokenizer, "chat_template", None):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
