"""The parts of a Kimi `tokenization_kimi.py` that specd reads (tokenizer_code.py), written
out small for tests: the class attributes, the special block of `__init__`, the
`apply_chat_template` of Kimi-K2's class (tool keys sorted) and of Kimi-K2.5's (sorted, then
declared in TypeScript; `thinking` and `preserve_thinking` handed on). Never run: specd
only parses it."""

from __future__ import annotations

from pathlib import Path

from specd.tiktoken_tokenizer import KIMI_PATTERN

K2_BLOCK = "self.num_reserved_special_tokens + 2"
K25_BLOCK = "self.num_reserved_special_tokens"

K2_CHAT = '''
    def apply_chat_template(self, conversation, tools=None, tokenize=False,
                            add_generation_prompt=True, **kwargs):
        tools = deep_sort_dict(tools)
        return super().apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt,
                                           **kwargs)
'''

K25_CHAT = '''
    def apply_chat_template(self, conversation, tools=None, tokenize=False,
                            add_generation_prompt=True, thinking=True,
                            preserve_thinking=False, **kwargs):
        """Sort, declare in TypeScript, hand on."""
        tools = deep_sort_dict(tools)
        tools_ts_str = None
        if tools:
            try:
                tools_ts_str = encode_tools_to_typescript_style(tools)
            except Exception as e:
                print(e)
                tools_ts_str = None
        if tools_ts_str is not None:
            kwargs['tools_ts_str'] = tools_ts_str
        return super().apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt,
                                           thinking=thinking,
                                           preserve_thinking=preserve_thinking, **kwargs)
'''


def kimi_code(block: str = K2_BLOCK, chat: str = K2_CHAT, registers: bool = False,
              typescript_import: bool = False) -> str:
    """The source of a tokenization_kimi.py with that special block end (after
    `num_base_tokens + `), that apply_chat_template (or none: ""), and whether __init__
    hands added_tokens_decoder on to transformers."""
    handed_on = "added_tokens_decoder=added_tokens_decoder, " if registers else ""
    imports = ("from .tool_declaration_ts import encode_tools_to_typescript_style\n"
               if typescript_import else "")
    return f'''from transformers.tokenization_utils import PreTrainedTokenizer
{imports}

class TikTokenTokenizer(PreTrainedTokenizer):
    num_reserved_special_tokens = 256
    pat_str = {KIMI_PATTERN!r}

    def __init__(self, vocab_file, added_tokens_decoder=None, **kwargs):
        names = {{i: t.content for i, t in (added_tokens_decoder or {{}}).items()}}
        mergeable_ranks = load_tiktoken_bpe(vocab_file)
        num_base_tokens = len(mergeable_ranks)
        self.special_tokens = {{
            names.get(i, f"<|reserved_token_{{i}}|>"): i
            for i in range(num_base_tokens, num_base_tokens + {block})
        }}
        super().__init__({handed_on}**kwargs)
{chat}

def deep_sort_dict(obj):
    return obj
'''


def write_kimi_code(root: Path, kind: str = "k2") -> None:
    """Kimi-K2's class ("k2") or Kimi-K2.5's ("k25", with its tool_declaration_ts.py)."""
    if kind == "k2":
        (root / "tokenization_kimi.py").write_text(kimi_code())
        return
    (root / "tokenization_kimi.py").write_text(
        kimi_code(K25_BLOCK, K25_CHAT, registers=True, typescript_import=True))
    (root / "tool_declaration_ts.py").write_text(
        "def encode_tools_to_typescript_style(tools):\n    return ''\n")
