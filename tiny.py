"""Tiny models built locally, for tests, the demo, the benches and the CPU recipes: nothing is downloaded.

    python tiny.py model --out runs/tiny-model --data ROWS [--max-position-embeddings 8192]
    python tiny.py vlm --out runs/tiny-vlm --data ROWS

build one whose tokenizer is trained on the text of ROWS (kiln rows or conversations, .parquet or .jsonl: every
message's text and every solution), so their prompts tokenize into few tokens. Untrained: it shows the pipeline run,
not learning (`make demo` warm-starts one with SFT).

`make_tiny_model` trains a byte-level BPE tokenizer on a corpus (Qwen2.5's pre-tokenization, its special tokens and a
Qwen2.5-style chat template with tool calls and image placeholders, or a Llama-3-style one) and builds a small Qwen2
model from a config, saved together as a Hugging Face folder that every kiln script loads like a real checkpoint.
`make_tiny_vlm` does the same for a Qwen2.5-VL (vision tower, mrope, image processor config, Qwen2.5-VL's chat
template).
"""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pyarrow.parquet as pq
import torch
import tyro
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (GenerationConfig, PreTrainedTokenizerFast, Qwen2_5_VLConfig,
                          Qwen2_5_VLForConditionalGeneration, Qwen2Config, Qwen2ForCausalLM)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT_REGEX
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import cli

# Ids 0..5 in every tiny tokenizer; the agent tokens are ordinary (non-special) added tokens, as in Qwen2.5.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
AGENT_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Qwen2.5's chat format: tool calls as <tool_call> JSON blocks, consecutive tool results grouped in one user turn,
# image parts as vision placeholders. No default system prompt is injected.
CHAT_TEMPLATE = (
    "{%- macro render(content) %}{% if content is string %}{{ content }}{% elif content %}{% for part in content %}"
    "{% if part.type == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{%- set skip_first = tools and messages and messages[0].role == 'system' %}"
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if skip_first %}{{ render(messages[0].content) + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call these functions (JSON signatures):\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nTo call one, reply with <tool_call>\\n{\"name\": <name>, \"arguments\": <JSON object>}"
    "\\n</tool_call><|im_end|>\\n' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + render(message.content) + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- elif not (loop.first and skip_first) %}{{ '<|im_start|>' + message.role }}"
    "{%- if message.content or not message.tool_calls %}{{ '\\n' + render(message.content) }}{% endif %}"
    "{%- for call in message.tool_calls or [] %}{% set fn = call.function if call.function is defined else call %}"
    "{{ '\\n<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{{ fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}{{ '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# Llama 3's chat format (its header and end-of-turn tokens, tool results as `ipython` turns, one per result), with tool
# calls written as the <tool_call> blocks kiln parses. As in a Llama 3 base model, the tokenizer's eos is
# <|end_of_text|>, not the <|eot_id|> that closes a turn: the end of a turn must come from the template.
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_CHAT_TEMPLATE = (
    "{%- macro render(content) %}{% if content is string %}{{ content }}{% elif content %}{% for part in content %}"
    "{% if part.type == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{{- bos_token }}"
    "{%- set skip_first = tools and messages and messages[0].role == 'system' %}"
    "{%- if tools %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if skip_first %}{{ render(messages[0].content) + '\\n\\n' }}{% endif %}"
    "{{ 'You may call these functions (JSON signatures):' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n\\nTo call one, reply with <tool_call>\\n{\"name\": <name>, \"arguments\": <JSON object>}"
    "\\n</tool_call><|eot_id|>' }}{% endif %}"
    "{%- for message in messages %}{% if not (loop.first and skip_first) %}"
    "{{ '<|start_header_id|>' + ('ipython' if message.role == 'tool' else message.role) + '<|end_header_id|>\\n\\n' }}"
    "{{- render(message.content) }}"
    "{%- for call in message.tool_calls or [] %}{% set fn = call.function if call.function is defined else call %}"
    "{{ '\\n<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{{ fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}{{ '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


# Qwen2-VL / Qwen2.5-VL-Instruct's chat format: a default system prompt when the conversation opens without one, every
# role rendered as given (no tools section), image and video parts as vision spans of one placeholder each.
VL_SPECIAL_TOKENS = SPECIAL_TOKENS + ["<|video_pad|>"]  # the config needs a video placeholder id too
VL_AGENT_TOKENS = AGENT_TOKENS + ["<code>", "</code>", "<answer>", "</answer>", "<sandbox_output>",
                                  "</sandbox_output>"]
QWEN2_VL_CHAT_TEMPLATE = (
    "{%- set counts = namespace(image=0, video=0) %}"
    "{%- for message in messages %}"
    "{%- if loop.first and message.role != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{ message.content }}"
    "{%- else %}{% for part in message.content %}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part %}{% set counts.image = counts.image + 1 %}"
    "{%- if add_vision_id %}{{ 'Picture ' + counts.image | string + ': ' }}{% endif %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'video' or 'video' in part %}{% set counts.video = counts.video + 1 %}"
    "{%- if add_vision_id %}{{ 'Video ' + counts.video | string + ': ' }}{% endif %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{ part.text }}{% endif %}"
    "{%- endfor %}{% endif %}{{ '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tiny_model(out_dir, corpus: list[str], vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                    max_position_embeddings: int = 4096, seed: int = 0,
                    chat_format: Literal["qwen", "llama3"] = "qwen") -> Path:
    """A Qwen2-shaped model from a config plus a byte-level BPE tokenizer trained on `corpus`, saved as a Hugging
    Face folder. chat_format: Qwen2.5's chat template and tokens, or Llama 3's (its tokens added after the others).
    Deterministic for a given corpus and seed; nothing is downloaded."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bpe = _byte_level_bpe(corpus, vocab_size, SPECIAL_TOKENS, AGENT_TOKENS)
    if chat_format == "llama3":
        bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_TOKENS])
        chat = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": LLAMA3_CHAT_TEMPLATE}
    else:
        chat = {"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<|endoftext|>", padding_side="left", clean_up_tokenization_spaces=False,
        model_max_length=max_position_embeddings, **chat)
    tokenizer.save_pretrained(out)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True, bos_token_id=pad,
        eos_token_id=eos, pad_token_id=pad)
    with torch.random.fork_rng():  # seeded init without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    # eos as in Qwen2.5-Instruct: <|im_end|> and <|endoftext|> both end a generation.
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out)
    return out


def _byte_level_bpe(corpus: list[str], vocab_size: int, special: list[str], added: list[str]) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `corpus`: `special` tokens first (ids 0..), `added` as ordinary added
    tokens after the merges."""
    # Qwen2.5's pipeline (NFC, its split regex, byte level): what transformers' Qwen2Tokenizer rebuilds on load.
    # Byte-level BPE round-trips any NFC text exactly; code is NFC.
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return bpe


def make_tiny_vlm(out_dir, corpus: list[str], vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2,
                  num_heads: int = 4, num_kv_heads: int = 2, vision_depth: int = 2, vision_hidden_size: int = 32,
                  min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 64, max_position_embeddings: int = 4096,
                  seed: int = 0, chat_template: str = QWEN2_VL_CHAT_TEMPLATE) -> Path:
    """A Qwen2.5-VL from a config (a small vision tower with windowed and full attention blocks, mrope) plus a
    byte-level BPE tokenizer trained on `corpus` with Qwen2.5-VL's special tokens and chat template, and the image
    processor's config (patch 14, merge 2; min_pixels/max_pixels bound each image's area), saved as a Hugging Face
    folder that loads like Qwen/Qwen2.5-VL-*-Instruct. Deterministic for a given corpus and seed; nothing is
    downloaded."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_bpe(corpus, vocab_size, VL_SPECIAL_TOKENS, VL_AGENT_TOKENS),
        eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left", clean_up_tokenization_spaces=False,
        model_max_length=max_position_embeddings, chat_template=chat_template)
    tokenizer.save_pretrained(out)
    # Saved as image_processor_type "Qwen2VLImageProcessor": AutoImageProcessor loads the torchvision class where
    # torchvision is installed, this PIL one where it is not.
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, temporal_patch_size=2,
                             merge_size=2).save_pretrained(out)
    token = tokenizer.convert_tokens_to_ids
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    head_dim = hidden_size // num_heads  # mrope's (t, h, w) sections split head_dim / 2 as Qwen2.5-VL's 16/24/24
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]}),
        vision_config=dict(
            depth=vision_depth, hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size, num_heads=2,
            out_hidden_size=hidden_size, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
            fullatt_block_indexes=[vision_depth - 1]),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out)
    return out


def corpus_of(path) -> list[str]:
    """The text of a data file (.parquet or .jsonl of kiln rows or conversations): each message's text (text parts of
    multimodal content) and each row's extra_info.solution, one string per row."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".parquet":
        records = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"--data {path}: expected .parquet or .jsonl")
    corpus = []
    for record in records:
        texts = []
        messages = record.get("prompt") or record.get("messages") or []
        if isinstance(messages, str):  # kiln's parquet stores a prompt with image parts as JSON text
            messages = json.loads(messages)
        for message in messages:
            content = message.get("content")
            texts += [content] if isinstance(content, str) else [p.get("text") or "" for p in content or []]
        texts.append((record.get("extra_info") or {}).get("solution") or "")
        corpus.append("\n".join(t for t in texts if t))
    if not any(corpus):
        raise ValueError(f"--data {path}: no text to train a tokenizer on")
    return corpus


@dataclass
class ModelArgs:
    out: str
    """the Hugging Face folder to write"""
    data: str
    """rows or conversations (.parquet / .jsonl) whose text trains the tokenizer"""
    hidden_size: int = 64
    """model width"""
    num_layers: int = 2
    """decoder layers"""
    max_position_embeddings: int = 4096
    """context length (SWE-bench prompts and trajectories want 8192)"""
    seed: int = 0
    """initialisation seed"""


@dataclass
class VlmArgs(ModelArgs):
    """A tiny Qwen2.5-VL (vision tower, image processor config) instead of a Qwen2."""


def main(args: ModelArgs) -> Path:
    corpus = corpus_of(args.data)
    build = make_tiny_vlm if isinstance(args, VlmArgs) else make_tiny_model
    out = build(args.out, corpus, hidden_size=args.hidden_size, num_layers=args.num_layers,
                max_position_embeddings=args.max_position_embeddings, seed=args.seed)
    print(f"tiny {'vision-language ' if isinstance(args, VlmArgs) else ''}model and tokenizer in {out} (tokenizer "
          f"trained on {len(corpus)} rows of {args.data})")
    return out


if __name__ == "__main__":
    with cli.one_line_errors():
        main(tyro.extras.subcommand_cli_from_dict({"model": ModelArgs, "vlm": VlmArgs}))
