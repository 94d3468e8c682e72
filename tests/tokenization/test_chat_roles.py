"""OpenAI's developer role for a template that does not know it: system instructions, one system
message first (as vLLM renders them); untouched for a template that has the role."""

from __future__ import annotations

from servelm.tokenization.chat_roles import developer_as_system
from servelm.tokenization.loading import load_tokenizer

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
KNOWS = "{% if m['role'] == 'developer' %}...{% endif %}"


def test_developer_messages_become_the_one_leading_system_message():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "developer", "content": "Answer in French."}, {"role": "developer", "content": ""}]  # fmt: skip
    assert developer_as_system(messages, CHATML) == [
        {"role": "system", "content": "Be brief.\n\nAnswer in French."}, {"role": "user", "content": "hi"}]  # fmt: skip
    assert developer_as_system(messages, KNOWS) is messages
    assert developer_as_system(messages, {"default": CHATML, "tool_use": KNOWS}) is messages
    plain = [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]
    assert developer_as_system(plain, CHATML) is plain  # no developer message: nothing to change


def test_the_default_models_template_renders_a_developer_message_as_its_system_prompt():
    template = load_tokenizer(None).chat_template
    developer = developer_as_system([{"role": "developer", "content": "One word."}, {"role": "user", "content": "Sky?"}],
                                    template)  # fmt: skip
    assert developer == [{"role": "system", "content": "One word."}, {"role": "user", "content": "Sky?"}]
