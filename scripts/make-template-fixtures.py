#!/usr/bin/env python3
"""Renders chat-template test cases with transformers' own renderer, for Kestrel's template tests.

    python3 scripts/make-template-fixtures.py    # needs transformers (no torch) and jinja2

Reads the published templates in crates/kestrel-text/tests/templates/*.jinja (their sources are in
that folder's README.md) and writes crates/kestrel-text/tests/templates/cases.json: for each case
the template file, the messages, tools and keyword arguments, and what
`transformers.utils.chat_template_utils.render_jinja_template` renders (or the message it raises).
"""
import json
import os

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "kestrel-text", "tests", "templates")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather at a place — in °C.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "days": {"type": "integer", "enum": [1, 2, 3]},
            },
            "required": ["city"],
        },
    },
}

QWEN = "Qwen-Qwen3-0.6B.jinja"
LLAMA = "meta-llama-Llama-3.2-3B-Instruct.jinja"

CASES = [
    ("qwen3 system and user", QWEN,
     [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}],
     None, {"add_generation_prompt": True}),
    ("qwen3 thinking off", QWEN,
     [{"role": "user", "content": "2+2?"}], None, {"add_generation_prompt": True, "enable_thinking": False}),
    ("qwen3 thinking on", QWEN,
     [{"role": "user", "content": "2+2?"}], None, {"add_generation_prompt": True, "enable_thinking": True}),
    ("qwen3 multi-turn with reasoning", QWEN,
     [{"role": "user", "content": "Name a prime."},
      {"role": "assistant", "content": "<think>\nSmall ones first.\n</think>\n\nTwo."},
      {"role": "user", "content": "Another, in français?"}],
     None, {"add_generation_prompt": True}),
    ("qwen3 tools and a tool call", QWEN,
     [{"role": "system", "content": "Use tools."},
      {"role": "user", "content": "Weather in Zürich?"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 1}}}]},
      {"role": "tool", "content": "{\"temp\": 21}"}],
     [WEATHER], {"add_generation_prompt": True}),
    ("qwen3 no generation prompt", QWEN,
     [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}], None, {}),
    ("llama3 system and user", LLAMA,
     [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hello!"}],
     None, {"add_generation_prompt": True, "bos_token": "<|begin_of_text|>", "date_string": "21 Nov 2026"}),
    ("llama3 tools in the user message", LLAMA,
     [{"role": "user", "content": "Weather in Zürich?"}],
     [WEATHER], {"add_generation_prompt": True, "bos_token": "<|begin_of_text|>", "date_string": "21 Nov 2026"}),
    ("llama3 tools in the system message", LLAMA,
     [{"role": "user", "content": "Weather?"},
      {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
      {"role": "tool", "content": "sunny"}],
     [WEATHER], {"add_generation_prompt": True, "bos_token": "<|begin_of_text|>", "date_string": "21 Nov 2026",
                 "tools_in_user_message": False}),
    ("llama3 multi-turn", LLAMA,
     [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"}, {"role": "user", "content": "Three"}],
     None, {"add_generation_prompt": False, "bos_token": "<|begin_of_text|>", "date_string": "01 Jan 2025"}),
    ("llama3 raise_exception", LLAMA,
     [{"role": "system", "content": "sys"}],
     [WEATHER], {"add_generation_prompt": True, "bos_token": "<|begin_of_text|>", "date_string": "21 Nov 2026"}),
]


def main():
    out = []
    for name, template, messages, tools, kwargs in CASES:
        source = open(os.path.join(HERE, template)).read()
        case = {"name": name, "template": template, "messages": messages, "tools": tools, "kwargs": kwargs}
        try:
            rendered, _ = render_jinja_template(
                conversations=[messages], tools=tools, chat_template=source, **kwargs)
            case["expected"] = rendered[0]
        except Exception as e:  # the template's raise_exception
            case["error"] = str(e)
        out.append(case)
    meta = {"transformers": transformers.__version__, "cases": out}
    with open(os.path.join(HERE, "cases.json"), "w") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"{len(out)} cases written")


if __name__ == "__main__":
    main()
