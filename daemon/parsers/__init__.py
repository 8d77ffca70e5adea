"""Parsers over a chat answer's detokenized text: tool calls and reasoning, in the front.

The model writes tool calls and its thinking as text in its own format; these parsers turn
that text, as it streams, into OpenAI's fields (`tool_calls`, `reasoning_content`). Every
parser is incremental and exact across splits: fed the same text in any pieces, it emits
events whose concatenation is the same, so a streamed answer and a whole one agree.
`events.py` names the events, `registry.py` the parsers and how one is chosen for a model.
"""
