"""Chat templates and token-in-token-out: prompts and conversations as the template renders them, tool calls parsed
from an assistant turn, the ids the template appends after a turn, and `check_tito`.

Token-in-token-out: prompts go to the engine as token ids, and a trajectory is the prompt ids, then generated ids
and (multi-turn) the chat template's ids for tool results, in turn. Nothing generated is ever decoded and encoded
again on the way to the trainer: text is decoded for the reward and the tools only. The loss mask is 1 exactly on
the tokens the policy generated. `check_tito` compares a trajectory with the template's rendering of its messages.
Tool output is tokenized as plain text: a tool cannot open or close a turn by printing the template's tokens.
"""
from __future__ import annotations

import json
import re

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOL_OUTPUT_MARK = "\ue000kiln tool output\ue000"  # a private-use character no template or tool writes


def end_of_turn(tokenizer, override: str | None = None) -> str:
    """The token that closes an assistant turn: `override` (checked to be one token), else the first special token
    the chat template writes after an assistant message's content (<|im_end|> in ChatML/Qwen, <|eot_id|> in Llama 3,
    <end_of_turn> in Gemma, </s> in Mistral). It stops generation, ends the loss mask and closes a tool-calling turn."""
    if override is not None:
        if len(tokenizer(override, add_special_tokens=False)["input_ids"]) != 1:
            raise ValueError(f"--end-of-turn {override!r} is not one token of the tokenizer")
        return override
    probe = "kiln end-of-turn probe"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}],
                                         tokenize=False)
    after = text[text.rindex(probe) + len(probe):]
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    found = next((i for i in tokenizer(after, add_special_tokens=False)["input_ids"] if i in special), None)
    if found is None:
        raise ValueError(f"the chat template writes no special token after an assistant message (it writes {after!r}): "
                         "name the token that ends a turn with --end-of-turn")
    return tokenizer.convert_ids_to_tokens(found)


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> prompt token ids, ending with the assistant header (tokenized once, never again)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_conversation(tokenizer, messages: list[dict], eot: str | None = None) -> tuple[list[int], list[int]]:
    """Chat messages -> (ids, loss mask), 1 exactly on assistant tokens (content and its end-of-turn token `eot`,
    default: end_of_turn's).

    Each message is tokenized alone as the text the template appends for it (tool output as plain text), so a
    conversation's ids are the concatenation a multi-turn rollout builds turn by turn: the same ids for training and
    for generation.
    """
    eot_id = tokenizer.convert_tokens_to_ids(eot or end_of_turn(tokenizer))
    ids, mask, rendered = [], [], ""
    for i, message in enumerate(messages):
        if message["role"] == "tool" and messages[i + 1 :] and messages[i + 1]["role"] == "tool":
            continue  # consecutive tool messages share one user turn: rendered together, with the last of them
        if message["role"] == "assistant":
            header = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            glue = tokenizer(header[len(rendered):], add_special_tokens=False)["input_ids"]
            ids += glue
            mask += [0] * len(glue)
            rendered = header
        text = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not text.startswith(rendered):
            raise ValueError(f"chat template does not render message {i} as an extension of the ones before it")
        plain = tool_spans(tokenizer, messages[: i + 1], None, False, text) if message["role"] == "tool" else []
        piece, _ = encode_text(tokenizer, text, plain, start=len(rendered))
        if message["role"] == "assistant":
            # Trained: everything up to and including the end-of-turn token; the template's trailing glue is not.
            end = len(piece)
            while end > 0 and piece[end - 1] != eot_id:
                end -= 1
            mask += [1] * end + [0] * (len(piece) - end)
        else:
            mask += [0] * len(piece)
        ids += piece
        rendered = text
    return ids, mask


def tool_spans(tokenizer, messages: list[dict], schemas: list[dict] | None, add_generation_prompt: bool, text: str,
               first: int = 0) -> list[tuple[int, int]]:
    """Character spans in `text`, the template's rendering of `messages`, of the tool outputs (messages from index
    `first` on) that hold a special token's text; each found by rendering its message with the output replaced by a
    marker. Outputs without special-token text need no span: they tokenize the same either way."""
    specials = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    spans = []
    for k in range(first, len(messages)):
        message = messages[k]
        if message["role"] != "tool" or not any(t in _content_text(message["content"]) for t in specials):
            continue
        marked = {**message, "content": _with_text(message["content"], TOOL_OUTPUT_MARK)}
        head, _, tail = render(tokenizer, messages[:k] + [marked] + messages[k + 1 :], schemas,
                               add_generation_prompt).partition(TOOL_OUTPUT_MARK)
        if TOOL_OUTPUT_MARK in tail or len(head) + len(tail) > len(text) or not (
                text.startswith(head) and text.endswith(tail)):
            raise ValueError(f"the chat template does not render the output of tool message {k} where its marker goes")
        spans.append((len(head), len(text) - len(tail)))
    return spans


def encode_text(tokenizer, text: str, plain: list[tuple[int, int]],
                start: int = 0) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character offsets (into `text`) of text[start:] as the tokenizer makes them, except that special tokens
    inside the character spans `plain` are ordinary text: a tool cannot end a turn or open one by printing the
    template's tokens. The tokenizer splits at special tokens anyway, so outside those spans nothing changes."""
    encoded = tokenizer(text[start:], add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], [(a + start, b + start) for a, b in encoded["offset_mapping"]]
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    in_plain = [any(lo <= a < hi for lo, hi in plain) for a, _ in offsets]
    if not any(i in special and inside for i, inside in zip(ids, in_plain)):
        return ids, offsets
    out_ids, out_offsets, pos = [], [], start
    template_tokens = [(i, (a, b)) for i, (a, b), inside in zip(ids, offsets, in_plain) if i in special and not inside]
    for token, (a, b) in template_tokens + [(None, (len(text), len(text)))]:
        if a > pos:  # the text between two of the template's special tokens, special-token text in it split up
            piece = tokenizer(text[pos:a], add_special_tokens=False, split_special_tokens=True,
                              return_offsets_mapping=True)
            out_ids += piece["input_ids"]
            out_offsets += [(x + pos, y + pos) for x, y in piece["offset_mapping"]]
        if token is not None:
            out_ids.append(token)
            out_offsets.append((a, b))
        pos = b
    return out_ids, out_offsets


def _content_text(content) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content or [])


def _with_text(content, text: str):
    """The content with its text replaced by `text` (its image parts kept)."""
    if isinstance(content, str):
        return text
    return [{"type": "text", "text": text} if p.get("type") == "text" else p for p in content]


def parse_tool_calls(text: str, known: set[str]) -> list[dict | str]:
    """Qwen2.5 tool calls in an assistant turn, in order: {"name", "arguments"} for a valid call, an error message
    (str) for a malformed one, so the model is told instead of the rollout crashing."""
    calls: list[dict | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(f"Error: the tool call is not valid JSON ({e.msg} at position {e.pos}): {body.strip()[:200]}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('Error: a tool call must be a JSON object {"name": <string>, "arguments": <object>}')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(f"Error: the arguments of {call['name']!r} must be a JSON object")
        elif call["name"] not in known:
            calls.append(f"Error: unknown tool {call['name']!r}; available: {', '.join(sorted(known))}")
        else:
            calls.append({"name": call["name"], "arguments": arguments})
    if text.count("<tool_call>") > len(TOOL_CALL.findall(text)):
        calls.append("Error: a <tool_call> was opened but not closed with </tool_call>")
    return calls


def render(tokenizer, messages: list[dict], schemas: list[dict] | None, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=schemas or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def template_suffix_ids(tokenizer, messages: list[dict], new_messages: list[dict],
                        schemas: list[dict] | None, eot: str | None = None) -> list[int]:
    """Ids the chat template appends after a trajectory that ends on its last assistant turn's end-of-turn token `eot`
    (default: end_of_turn's), for `new_messages` plus the next assistant header: the template's glue after that token,
    then the new ones (tool output tokenized as plain text)."""
    eot = eot or end_of_turn(tokenizer)
    before = render(tokenizer, messages, schemas, add_generation_prompt=False)
    after = render(tokenizer, messages + new_messages, schemas, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template does not render the new messages as an extension of the conversation")
    cut = before.rindex(eot) + len(eot)  # the trajectory ends right after this token
    plain = tool_spans(tokenizer, messages + new_messages, schemas, True, after, first=len(messages))
    return encode_text(tokenizer, after, plain, start=cut)[0]


def truncate_tool_text(tokenizer, text: str, max_tokens: int) -> tuple[str, bool]:
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]  # as it will be encoded
    if len(ids) <= max_tokens:
        return text, False
    return tokenizer.decode(ids[:max_tokens]) + f"\n[... truncated {len(ids) - max_tokens} tokens]", True


def check_tito(tokenizer, sample, messages: list[dict], tools: list[dict] | None = None,
               eot: str | None = None) -> list[str]:
    """Drift between a trajectory (a rollout.Sample, or anything with its ids, prompt_ids and loss_mask) and the chat
    template's rendering of the same messages (tokenized whole, tool output as plain text): ids that differ, and
    loss-mask positions that are not exactly the assistant turns' content plus their end-of-turn token `eot` (default:
    end_of_turn's). Returns human-readable findings; [] = no drift."""
    eot = eot or end_of_turn(tokenizer)
    text = render(tokenizer, messages, tools, add_generation_prompt=False)
    plain = tool_spans(tokenizer, messages, tools, False, text)
    if messages[-1]["role"] == "assistant" and sample.ids and sample.ids[-1] == tokenizer.convert_tokens_to_ids(eot):
        text = text[: text.rindex(eot) + len(eot)]  # the trajectory ends on the policy's token
    want, offsets = encode_text(tokenizer, text, plain)
    findings = []
    got = sample.ids
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if first < max(len(got), len(want)):
        findings.append(f"ids drift at token {first} of {len(got)} (template: {len(want)} tokens): trajectory "
                        f"{tokenizer.decode(got[first:first + 8])!r} vs template "
                        f"{tokenizer.decode(want[first:first + 8])!r}")
        return findings
    spans = []  # character spans of each assistant turn: content + end-of-turn token
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            begin = len(render(tokenizer, messages[:i], tools, add_generation_prompt=True))
            end = render(tokenizer, messages[: i + 1], tools, add_generation_prompt=False).rindex(eot)
            spans.append((begin, end + len(eot)))
    want_mask = [int(any(b <= s and e <= c for b, c in spans)) for s, e in offsets]
    mask = [0] * len(sample.prompt_ids) + list(sample.loss_mask)
    wrong = [i for i, (a, b) in enumerate(zip(mask, want_mask)) if a != b]
    if wrong:
        findings.append(f"loss mask drift at {len(wrong)} tokens, first {wrong[0]} "
                        f"({tokenizer.decode(got[wrong[0]:wrong[0] + 1])!r}: mask {mask[wrong[0]]}, "
                        f"want {want_mask[wrong[0]]})")
    return findings
