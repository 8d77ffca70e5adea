"""Kimi-K2.5 as Moonshot publishes it, shrunk to the INT4 MoE fixture, served by the real
daemon: the directory starts, its vision tower is skipped with one line, its tokenizer
(K2.5's 256-id special block, its chat template, its tools in TypeScript) renders a chat
request, greedy decoding gives the oracle's tokens with speculation off and on, and
`specctl plan` says it fits.

The directory (`kimi_k25_dir`), built from workers/fixture-moe quantized by
`tools.quantize --recipe moe` (routed experts INT4, group 32):

* `config.json`: the published file's fields, as public copies show them (a transformers
  dump of moonshotai/Kimi-K2.5's config.json, the nested layout other engines' tests copy
  from it, transformers' own Kimi-K2.5 config reading `text_config.model_type` `kimi_k2`),
  with sizes shrunk to the fixture's. Kept at the top level: `architectures`
  (`KimiK25ForConditionalGeneration`), `auto_map`, `bos_token_id`, `dtype`, `eos_token_id`,
  `ignore_index`, `media_placeholder_token_id`, `model_type` (`kimi_k25`), `pad_token_id`,
  `quantization_config`, `text_config`, `tie_word_embeddings`, `transformers_version`,
  `use_unified_vision_chunk`, `video_placeholder`, `vision_config` (MoonViT's
  `init_pos_emb_*`, `merge_kernel_size`, `merge_type`, `mm_hidden_size`,
  `mm_projector_type`, `model_type` "", `patch_size`, `pos_emb_type`,
  `projector_hidden_act`, `projector_ln_eps`, `text_hidden_size`, `video_attn_type`,
  `vt_*`). In `text_config`: the DeepSeek-V3 fields of TEXT_KEYS with the fixture's values,
  `architectures` `DeepseekV3ForCausalLM`, `model_type` `kimi_k2`, the DeepSeek reference
  code's `auto_map`, `aux_loss_alpha`, `dtype`, `ep_size`, `moe_layer_freq`,
  `num_nextn_predict_layers` 0, `scoring_func`, `seq_aux`, `topk_method`, the special ids,
  `rope_theta` with the older `rope_scaling` (`type: yarn`) as Kimi's configs spell rope,
  and the quantization_config again, as the release carries it in both places. Left out:
  the generic defaults transformers adds when it writes a config back (`id2label`,
  `return_dict`, ...). The ids (bos, eos, pad, media placeholder) are the published ones
  moved down with the block: published id - 163,584 + the fixture's 3,840 ranks.
* Tensors: the language model under `language_model.` (`language_model.model.layers...`,
  `language_model.lm_head.weight`), beside the vision tower and projector under their
  published names (`vision_tower.patch_embed...`, `vision_tower.encoder.blocks.N...`,
  `mm_projector...`) at shrunk shapes, in three shards with `model.safetensors.index.json`
  (the vision parts in the last, as published).
* Tokenizer: `tiktoken.model` with the fixture tokenizer's byte-level tokens as ranks (every
  single byte; rank r is the fixture's token r for r >= 3, ranks 0..2 the next merges), so
  ranks + 256 = 4,096 = the embedding's rows; `tokenization_kimi.py` of K2.5's structure
  (the 256-id block, `added_tokens_decoder` handed on, tools sorted and declared in
  TypeScript) and `tool_declaration_ts.py`, the project's own stand-ins
  (tests/unit/kimi_tokenizer_files.py); `tokenizer_config.json` with Kimi's fields
  (`auto_map` to `tokenization_kimi.TikTokenTokenizer`, `[BOS]`, `[EOS]`, `[PAD]`,
  `[UNK]`, the named tokens of NAMED); `chat_template.jinja`, the project's own template in
  K2.5's style (CHAT_TEMPLATE).
* `quantization_config.ignore`, parametrized: the list the K2.5 release carries
  (Kimi-K2-Thinking's: an exact `lm_head`, which names no module of the prefixed layout, so
  lm_head, stored dense, loads dense with one `lm_head_dense` line), and the prefixed list
  a quantizer writes for the wrapper (`language_model.lm_head`, the vision tower and
  projector).

Oracle: transformers' `DeepseekV3ForCausalLM` over the unwrapped INT4 directory through
compressed-tensors (the decompressed language model), greedy in float32, on held-out prompts
sent as token ids (the tokenizer is synthetic: ids matter, text does not) and on the chat
request's prompt, whose ids are checked first against tiktoken itself over the text the
template must render (CHAT_TEXT, written out). Speculation "on": the fixture-moe's own
EAGLE-3 head drafts, and drafts must be accepted; "off": none is drafted.

A Kimi-K2 rule (258 special ids) is no start-up failure here (its two extra ids are unnamed,
and only their own text gives them), so the test tells the rules apart by the vocabulary
(4,096 = the rows) and by the text of id 4,096, plain text under K2.5's rule.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiktoken
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from specd.daemon.ctl.cli import cli
from specd.ipc import messages as m
from specd.ipc.generation import Collector, GenerateResult
from specd.ipc.sampling import SamplingParams
from specd.tiktoken_tokenizer import KIMI_PATTERN
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_MOE_DIR
from tests.integration.daemon_harness import Daemon
from tests.integration.heldout import heldout_prompt_ids
from tests.integration.test_engine_parity import hf_greedy
from tests.unit.kimi_tokenizer_files import write_kimi_code
from tools import quantize as quantize_tool

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
# Held-out prompts of 43, 60 and 77 tokens, whose greedy continuations are not a two-token
# loop (the shorter ones' are), so a wrong token shows.
PROMPTS = heldout_prompt_ids(5, 9, 17)[2:]
NUM_RANKS = 4096 - 256  # the fixture's embedding rows less K2.5's special block
PUBLISHED_BLOCK_START = 163584  # Kimi's first special id (its tiktoken.model has 163,584 ranks)
KIMI_RULES = ["re:.*self_attn.*", "re:.*shared_experts.*",
              r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
IGNORE_LISTS = {
    "published": ["lm_head", *KIMI_RULES],
    "prefixed": ["language_model.lm_head", *KIMI_RULES, "re:.*vision_tower.*",
                 "re:.*mm_projector.*"],
}
# K2.5's named special tokens, by offset from the block's start: 0-17 as a public copy of
# Kimi-K2's tokenizer_config.json names them (the tool-call markers not special: decode
# keeps them), the media tokens where transformers' Kimi-K2.5 config puts the vision ids
# (163602, 163604; config.json's media placeholder 163605), the think tokens after them
# (not special, as the project's Kimi tokenizer tests take them); [UNK] and [PAD]
# (config.json's pad 163839) last.
NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
         6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
         11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
         13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
         17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>",
         20: "<|media_end|>", 21: "<|media_pad|>", 22: "<think>", 23: "</think>",
         254: "[UNK]", 255: "[PAD]"}
NOT_SPECIAL = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
               "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
               "<think>", "</think>")
# The published text_config's fields whose values the fixture's config.json gives (sizes,
# norms, routing); the others are set as published.
TEXT_KEYS = ("attention_bias", "attention_dropout", "first_k_dense_replace", "hidden_act",
             "hidden_size", "initializer_range", "intermediate_size", "kv_lora_rank",
             "max_position_embeddings", "moe_intermediate_size", "n_group", "n_routed_experts",
             "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok",
             "num_hidden_layers", "num_key_value_heads", "pretraining_tp", "q_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "routed_scaling_factor",
             "tie_word_embeddings", "topk_group", "use_cache", "v_head_dim", "vocab_size")
VISION_TENSORS = {  # name -> shape: MoonViT and its projector, one block, width 16
    "vision_tower.patch_embed.proj.weight": (16, 3, 14, 14),
    "vision_tower.patch_embed.proj.bias": (16,),
    "vision_tower.patch_embed.pos_emb.weight": (4, 4, 16),
    "vision_tower.encoder.blocks.0.norm0.weight": (16,),
    "vision_tower.encoder.blocks.0.norm0.bias": (16,),
    "vision_tower.encoder.blocks.0.wqkv.weight": (48, 16),
    "vision_tower.encoder.blocks.0.wqkv.bias": (48,),
    "vision_tower.encoder.blocks.0.wo.weight": (16, 16),
    "vision_tower.encoder.blocks.0.wo.bias": (16,),
    "vision_tower.encoder.blocks.0.norm1.weight": (16,),
    "vision_tower.encoder.blocks.0.norm1.bias": (16,),
    "vision_tower.encoder.blocks.0.mlp.fc0.weight": (32, 16),
    "vision_tower.encoder.blocks.0.mlp.fc0.bias": (32,),
    "vision_tower.encoder.blocks.0.mlp.fc1.weight": (16, 32),
    "vision_tower.encoder.blocks.0.mlp.fc1.bias": (16,),
    "vision_tower.encoder.final_layernorm.weight": (16,),
    "vision_tower.encoder.final_layernorm.bias": (16,),
    "mm_projector.pre_norm.weight": (16,),
    "mm_projector.pre_norm.bias": (16,),
    "mm_projector.proj.0.weight": (64, 64),
    "mm_projector.proj.0.bias": (64,),
    "mm_projector.proj.2.weight": (128, 64),
    "mm_projector.proj.2.bias": (128,),
}

# The project's own chat template in K2.5's style: the tools declared once (TypeScript when
# the tokenizer code made `tools_ts_str`, else JSON), a default system turn, every turn as
# <|im_ROLE|>name<|im_middle|>...<|im_end|>, earlier assistant turns with an empty think
# block, the turns after the last user message with their reasoning_content, tool results
# headed by their call id, and the generation prompt opening <think> unless thinking is off.
CHAT_TEMPLATE = """\
{%- macro content(m) -%}
{%- if m.content is string -%}{{ m.content }}
{%- elif m.content is not none -%}{% for part in m.content %}{{ part.text }}{% endfor %}
{%- endif -%}
{%- endmacro -%}
{%- macro head(m) -%}
{%- if m.role == 'user' -%}<|im_user|>{{ m.name or 'user' }}<|im_middle|>
{%- elif m.role == 'assistant' -%}<|im_assistant|>{{ m.name or 'assistant' }}<|im_middle|>
{%- else -%}<|im_system|>{{ m.name or m.role }}<|im_middle|>
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}
{%- endif -%}{%- endfor -%}
{%- if tools -%}<|im_system|>tool_declare<|im_middle|>
{%- if tools_ts_str -%}{{ tools_ts_str }}{%- else -%}{{ tools | tojson }}{%- endif -%}
<|im_end|>
{%- endif -%}
{%- if not messages or messages[0].role != 'system' -%}
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- for m in messages -%}
{{ head(m) }}
{%- if m.role == 'assistant' -%}
{%- if loop.index0 > ns.last_user and thinking is not false -%}
<think>{{ m.reasoning_content or '' }}</think>
{%- else -%}<think></think>
{%- endif -%}
{{ content(m) }}
{%- if m.tool_calls -%}<|tool_calls_section_begin|>
{%- for call in m.tool_calls -%}
<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>
{{- call.function.arguments }}<|tool_call_end|>
{%- endfor -%}<|tool_calls_section_end|>
{%- endif -%}
{%- elif m.role == 'tool' -%}## Return of {{ m.tool_call_id }}
{{ content(m) }}
{%- else -%}{{ content(m) }}
{%- endif -%}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>
{%- if thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}
{%- endif -%}
"""

TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "City name"}}}}}]
CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
CHAT: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
     "tool_calls": [CALL]},
    {"role": "tool", "content": "18 C", "tool_call_id": "functions.get_weather:0"}]
# What the template must render for CHAT and TOOLS: K2.5's TypeScript declaration of the
# tool, the default system turn, the reasoning of the turn after the last user message.
CHAT_TEXT = (
    "<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n"
    "// Weather in a city\ntype get_weather = (_: {\n  // City name\n  city: string\n"
    "}) => any;\n}\n<|im_end|>"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
    "<|im_end|>"
    "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>Call the tool.</think>"
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
    "<|tool_calls_section_end|><|im_end|>"
    "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18 C<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the fixture tokenizer's pre-tokenizer
    spells every byte as one printable character)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def write_tiktoken_ranks(root: Path) -> None:
    """`root/tiktoken.model` with NUM_RANKS ranks from the fixture tokenizer's byte-level
    tokens: rank r is its token r (r >= 3; 3..258 are the 256 single bytes), ranks 0..2
    (its special tokens there) the bytes of its next merges."""
    vocab = json.loads((FIXTURE_MOE_DIR / "tokenizer.json").read_text())["model"]["vocab"]
    by_id = {i: s for s, i in vocab.items()}
    decoder = _byte_decoder()
    token = [bytes(decoder[c] for c in by_id[i]) for i in range(len(by_id)) if i >= 3]
    ranks = token[NUM_RANKS - 3:NUM_RANKS] + token[:NUM_RANKS - 3]
    assert len(set(ranks)) == NUM_RANKS and {bytes([b]) for b in range(256)} <= set(ranks)
    (root / "tiktoken.model").write_text("".join(
        f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(ranks)))


def write_tokenizer(root: Path) -> None:
    write_tiktoken_ranks(root)
    write_kimi_code(root, "k25")
    added = {str(NUM_RANKS + offset): {
        "content": name, "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": name not in NOT_SPECIAL}
        for offset, name in NAMED.items()}
    (root / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "clean_up_tokenization_spaces": False, "eos_token": "[EOS]",
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "[PAD]", "tokenizer_class": "TikTokenTokenizer", "unk_token": "[UNK]"},
        indent=2))
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _published_id(published: int) -> int:
    return published - PUBLISHED_BLOCK_START + NUM_RANKS


def k25_config(text: dict[str, Any], ignore: list[str]) -> dict[str, Any]:
    """Kimi-K2.5's config.json around the fixture's language model `text` (its config.json):
    the published text_config's fields with the fixture's values (TEXT_KEYS), the rest as
    published."""
    qcfg = dict(text["quantization_config"], ignore=ignore)
    rope = text["rope_parameters"]
    ids = {"bos_token_id": _published_id(163584), "eos_token_id": _published_id(163585),
           "pad_token_id": _published_id(163839)}
    text_config = {
        **{k: text[k] for k in TEXT_KEYS},
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModel": "modeling_deepseek.DeepseekV3Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "aux_loss_alpha": 0.001, "dtype": "bfloat16", "ep_size": 1, "model_type": "kimi_k2",
        "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "quantization_config": qcfg,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {**{k: v for k, v in rope.items() if k not in ("rope_theta",
                                                                       "rope_type")},
                         "type": rope["rope_type"]},
        "scoring_func": "sigmoid", "seq_aux": True, "topk_method": "noaux_tc", **ids}
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM":
                         "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "dtype": "bfloat16", "ignore_index": -100,
        "media_placeholder_token_id": _published_id(163605), "model_type": "kimi_k25",
        "quantization_config": qcfg, "text_config": text_config,
        "tie_word_embeddings": False, "transformers_version": "4.57.1",
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "vision_config": {
            "init_pos_emb_height": 4, "init_pos_emb_time": 4, "init_pos_emb_width": 4,
            "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_hidden_size": 16,
            "mm_projector_type": "patchmerger", "model_type": "", "patch_size": 14,
            "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-05, "text_hidden_size": text["hidden_size"],
            "video_attn_type": "spatial_temporal", "vt_hidden_size": 16,
            "vt_intermediate_size": 32, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1},
        **ids}


def write_shards(int4_dir: Path, root: Path) -> dict[str, str]:
    """The INT4 fixture's tensors under `language_model.` and the vision parts, in three
    shards (layers 0-1; layers 2-3 with the embedding, norm and lm_head; the vision tower
    and projector), with the index. Returns the weight map."""
    with safe_open(str(int4_dir / "model.safetensors"), framework="pt") as f:
        tensors = {f"language_model.{k}": f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    g = torch.Generator().manual_seed(0)
    vision = {name: torch.randn(shape, generator=g).to(torch.bfloat16)
              for name, shape in VISION_TENSORS.items()}
    first = {k: v for k, v in tensors.items()
             if k.startswith(("language_model.model.layers.0.", "language_model.model.layers.1."))}
    shards = [first, {k: v for k, v in tensors.items() if k not in first}, vision]
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
        total += sum(t.numel() * t.element_size() for t in shard.values())
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2))
    return weight_map


def kimi_k25_dir(int4_dir: Path, root: Path, ignore: list[str]) -> Path:
    """Kimi-K2.5's published layout (module docstring) of the INT4 fixture in `root`."""
    root.mkdir(parents=True)
    text = json.loads((int4_dir / "config.json").read_text())
    (root / "config.json").write_text(json.dumps(k25_config(text, ignore), indent=2))
    write_shards(int4_dir, root)
    write_tokenizer(root)
    return root


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe-int4") / "int4"
    assert quantize_tool.main([str(FIXTURE_MOE_DIR), str(out), "--recipe", "moe"]) == 0
    return out


def oracle_encoding(model_dir: Path) -> tiktoken.Encoding:
    """tiktoken itself over the directory's ranks with K2.5's block: ids NUM_RANKS to
    NUM_RANKS + 255, named from NAMED, the rest `<|reserved_token_{id}|>`."""
    ranks = {base64.b64decode(token): int(rank) for token, rank in (
        line.split() for line in (model_dir / "tiktoken.model").read_text().splitlines())}
    specials = {NAMED.get(i - NUM_RANKS, f"<|reserved_token_{i}|>"): i
                for i in range(NUM_RANKS, NUM_RANKS + 256)}
    return tiktoken.Encoding("k25-oracle", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials)


@pytest.fixture(scope="module")
def chat_ids(int4_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    """The chat request's prompt: CHAT_TEXT as tiktoken encodes it with K2.5's block."""
    root = tmp_path_factory.mktemp("ranks")
    write_tiktoken_ranks(root)
    return oracle_encoding(root).encode(CHAT_TEXT, allowed_special="all")


@pytest.fixture(scope="module")
def expected(int4_dir: Path, chat_ids: list[int]) -> list[list[int]]:
    """transformers' greedy continuations (float32) of the held-out prompts and the chat
    prompt, over the unwrapped INT4 checkpoint through compressed-tensors."""
    torch.set_num_threads(2)
    return hf_greedy(int4_dir, [*PROMPTS, chat_ids], NEW_TOKENS)


@pytest.fixture(scope="module", params=sorted(IGNORE_LISTS))
def k25(request: pytest.FixtureRequest, int4_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = str(request.param)
    return name, kimi_k25_dir(int4_dir, tmp_path_factory.mktemp("k25") / "Kimi-K2.5",
                              IGNORE_LISTS[name])


@pytest.fixture(scope="module")
def daemon(k25: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Daemon]:
    """The real daemon on the directory, the fixture's EAGLE-3 head drafting (a chain of 4);
    float32 and no measured auto mode, so that the mode is the one the test sets."""
    _, model_dir = k25
    d = Daemon(tmp_path_factory.mktemp("daemon"), "--model", str(model_dir),
               "--draft-model", str(FIXTURE_MOE_DIR / "eagle3"), "--dtype", "float32",
               "--spec-mode", "on", "--no-spec-auto-measure", "--spec-topk", "1",
               "--spec-num-steps", "4", "--max-num-batched-tokens", "64")
    try:
        yield d.wait_ready()
    finally:
        d.stop()


def _messages() -> list[m.ChatMessage]:
    return [m.ChatMessage(**message) for message in CHAT]


def _chat(daemon: Daemon, sampling: SamplingParams) -> GenerateResult:
    """The chat request (CHAT with TOOLS) through the socket."""
    collector = Collector()
    with daemon.client(timeout=300) as client:
        request = m.Generate(id=client.next_id(), messages=_messages(), tools=TOOLS,
                             sampling=sampling)
        client.send(request)
        while not isinstance(reply := client.receive(), m.Final):
            assert isinstance(reply, m.Delta) and reply.id == request.id, reply
            collector.add(reply)
    return collector.result(reply)


def _tokenize(daemon: Daemon, **options: Any) -> list[int]:
    with daemon.client() as client:
        client.send(m.Tokenize(id=client.next_id(), messages=_messages(), tools=TOOLS,
                               **options))
        reply = client.receive()
    assert isinstance(reply, m.Tokens), reply
    return reply.token_ids


def test_the_directory_is_laid_out_as_published(k25: tuple[str, Path]) -> None:
    """What the test builds is what it claims: the wrapper config, three shards indexed,
    the vision parts beside the language model, ranks + 256 = the embedding's rows."""
    _, model_dir = k25
    config = json.loads((model_dir / "config.json").read_text())
    text = config["text_config"]
    assert (config["model_type"], text["model_type"]) == ("kimi_k25", "kimi_k2")
    assert config["quantization_config"] == text["quantization_config"]
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())[
        "weight_map"]
    assert len(set(weight_map.values())) == 3
    assert {n for n in weight_map if not n.startswith("language_model.")} == set(
        VISION_TENSORS)
    assert "language_model.lm_head.weight" in weight_map
    ranks = (model_dir / "tiktoken.model").read_text().splitlines()
    assert len(ranks) + 256 == text["vocab_size"] == 4096
    assert not (model_dir / "tokenizer.json").exists()


def test_k25s_special_block_is_256_ids(k25: tuple[str, Path]) -> None:
    """specd reads the 256-id block from K2.5's tokenization_kimi.py: its tokenizer has
    exactly the embedding's rows, and `<|reserved_token_4096|>` (an id of Kimi-K2's 258-id
    rule) is plain text. The same directory with Kimi-K2's class counts 258 and encodes
    that text to id 4096, a row the model does not have: the probe tells the rules apart."""
    _, model_dir = k25
    probe = f"<|reserved_token_{NUM_RANKS + 256}|>"
    ours = Tokenizer.from_dir(model_dir)
    assert ours.vocab_size == ours.num_named_ids == 4096
    assert ours.encode(probe) == oracle_encoding(model_dir).encode(probe, allowed_special="all")
    assert max(ours.encode(probe)) < NUM_RANKS
    k2 = model_dir.parent / "with-k2-class"
    shutil.copytree(model_dir, k2)
    write_kimi_code(k2, "k2")
    theirs = Tokenizer.from_dir(k2)
    assert theirs.vocab_size == 4098 and theirs.encode(probe) == [NUM_RANKS + 256]


def test_specctl_plan_says_it_fits(k25: tuple[str, Path]) -> None:
    _, model_dir = k25
    draft = FIXTURE_MOE_DIR / "eagle3"
    result = CliRunner().invoke(cli, ["plan", str(model_dir), "--draft-model", str(draft),
                                      "--gpu-memory-gib", "1", "--reserve-gib", "0.25"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.startswith("verdict      fits:") for line in lines), result.output
    assert f"serve with   specd --model {model_dir} --device cuda --draft-model {draft}" in (
        result.output)


def test_starts_skipping_the_vision_tower_with_one_line(k25: tuple[str, Path],
                                                        daemon: Daemon) -> None:
    """One record for the vision tower and projector; lm_head dense, said once, where the
    published list's exact `lm_head` does not name the prefixed module (and nothing said
    where the prefixed list ignores it)."""
    name, _ = k25
    (skipped,) = daemon.events("unserved_tensors_skipped")
    assert skipped["count"] == len(VISION_TENSORS)
    assert skipped["weight_prefix"] == "language_model."
    dense = daemon.events("lm_head_dense")
    assert len(dense) == (1 if name == "published" else 0)


def test_the_daemon_encodes_with_k25s_block(k25: tuple[str, Path], daemon: Daemon) -> None:
    """Through the daemon too, a named special token's text is its id and the text of the
    id past K2.5's block (one of Kimi-K2's 258) is plain text."""
    encoding = oracle_encoding(k25[1])
    with daemon.client() as client:
        for text in ("<|im_user|>user<|im_middle|>hi<|im_end|>",
                     f"a<|reserved_token_{NUM_RANKS + 100}|><|reserved_token_{NUM_RANKS + 256}|>"):
            assert client.tokenize(text) == encoding.encode(text, allowed_special="all")
        assert client.tokenize("<|im_end|>") == [NUM_RANKS + 2]


def test_the_chat_request_renders_k25s_prompt(k25: tuple[str, Path], daemon: Daemon,
                                              chat_ids: list[int]) -> None:
    """The tools in TypeScript, the default system turn, the tool call with its reasoning,
    the result, `<think>` opened: the ids tiktoken gives for CHAT_TEXT. With thinking off,
    the reasoning goes and the generation prompt closes the think block."""
    assert _tokenize(daemon) == chat_ids
    off = _tokenize(daemon, chat_template_kwargs={"thinking": False})
    assert off == oracle_encoding(k25[1]).encode(
        CHAT_TEXT.replace("<think>Call the tool.</think>", "<think></think>")
        + "</think>", allowed_special="all")


@pytest.mark.parametrize("mode", ["on", "off"])
def test_greedy_tokens_equal_transformers(daemon: Daemon, chat_ids: list[int],
                                          expected: list[list[int]], mode: str) -> None:
    """Held-out prompts as token ids, then the chat request, with speculation on (drafts
    accepted) and off (none drafted): transformers' tokens, float32."""
    with daemon.client() as client:
        assert client.set_spec(mode)
    sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    drafted = accepted = 0
    outputs = []
    with daemon.client(timeout=300) as client:
        for ids in PROMPTS:
            result = client.generate(prompt_token_ids=ids, sampling=sampling)
            outputs.append(result.token_ids)
            drafted, accepted = drafted + result.num_drafted, accepted + result.num_accepted
    chat = _chat(daemon, sampling)
    assert chat.num_prompt_tokens == len(chat_ids)
    outputs.append(chat.token_ids)
    drafted, accepted = drafted + chat.num_drafted, accepted + chat.num_accepted
    assert outputs == expected
    if mode == "on":
        assert accepted > 0 and drafted > 0
    else:
        assert drafted == 0
