"""Chat templates and token-in-token-out: prompts and conversations as the template renders them, tool calls parsed
from an assistant turn, the ids the template appends after a turn, and `check_tito`.

Token-in-token-out: prompts go to the engine as token ids, and a trajectory is the prompt ids, then generated ids
and (multi-turn) the chat template's ids for tool results, in turn. Nothing generated is ever decoded and encoded
again on the way to the trainer: text is decoded for the reward and the tools only. The loss mask is 1 exactly on
the tokens the policy generated. `check_tito` compares a trajectory with the template's rendering of its messages.
Tool output is tokenized as plain text: a tool cannot open or close a turn by printing the template's tokens.

Two action protocols: Qwen2.5's `<tool_call>` JSON blocks (tool results in `tool` messages), and CodeV's tags: the
policy writes <code>```python ...```</code> and generation stops on `</code>`; the turn is closed by the template's
end-of-turn token, which the policy did not sample (loss mask 0), and the sandbox's reply follows as a user turn
`<sandbox_output>text</sandbox_output>` with one image part per returned image (rendered unexpanded, as the template
writes it: <|vision_start|><|image_pad|><|vision_end|>); a turn with <answer>, or without code, ends the episode.
Rendered as chat messages, the tag protocol needs nothing but the template: training, generation and any chat server
see the same tokens.
"""
from __future__ import annotations

import hashlib
import json
import re
import textwrap
import weakref
from importlib.metadata import version

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOL_OUTPUT_MARK = "\ue000kiln tool output\ue000"  # a private-use character no template or tool writes
CODE_OPEN, CODE_STOP, ANSWER_OPEN = "<code>", "</code>", "<answer>"
OBSERVATION_OPEN, OBSERVATION_CLOSE = "<sandbox_output>", "</sandbox_output>"
CODE_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n?(.*?)```", re.DOTALL)
IMAGE_PAD = "<|image_pad|>"
DECODE_CONTEXT = 8  # tokens decoded before each one: a decoder treats a text's first token or a split character apart
SUFFIX_WINDOW = 2  # messages before the new ones that a turn's suffix is rendered after (besides the first message)
# A conversation of every kind of turn, on which `renders_locally` compares a template's suffixes rendered after the
# whole history and after its window.
LOCALITY_PROBE = [
    {"role": "system", "content": "probe system"}, {"role": "user", "content": "probe task"},
    {"role": "assistant", "content": 'probe <tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'},
    {"role": "tool", "content": "probe output 1"},
    {"role": "assistant", "content": "probe call", "tool_calls": [
        {"type": "function", "function": {"name": "bash", "arguments": {"command": "pwd"}}}]},
    {"role": "tool", "content": "probe output 2"}, {"role": "tool", "content": "probe output 3"},
    {"role": "assistant", "content": "probe reply"}, {"role": "user", "content": "probe follow-up"},
    {"role": "assistant", "content": "probe answer"}, {"role": "tool", "content": "probe output 4"},
    {"role": "assistant", "content": "probe end"}]
_locality: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {tool signatures: renders_locally}


def special_ids(tokenizer) -> set[int]:
    """The tokenizer's special tokens: those of its template (<|im_end|>, <|eot_id|>) as well as bos/eos/pad
    (`all_special_ids` leaves out added special tokens that have no role such as eos)."""
    return {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}


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
    special = special_ids(tokenizer)
    found = next((i for i in tokenizer(after, add_special_tokens=False)["input_ids"] if i in special), None)
    if found is None:
        raise ValueError(f"the chat template writes no special token after an assistant message (it writes {after!r}): "
                         "name the token that ends a turn with --end-of-turn")
    return tokenizer.convert_ids_to_tokens(found)


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> prompt token ids, ending with the assistant header (tokenized once, never again)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_conversation(tokenizer, messages: list[dict], eot: str | None = None,
                        tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Chat messages (rendered with the tool signatures `tools`, as a rollout's prompt is) -> (ids, loss mask), 1
    exactly on assistant tokens (content and its end-of-turn token `eot`, default: end_of_turn's; a code action's
    end-of-turn token is not the policy's: 0).

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
            header = render(tokenizer, messages[:i], tools, add_generation_prompt=True)
            glue = tokenizer(header[len(rendered):], add_special_tokens=False)["input_ids"]
            ids += glue
            mask += [0] * len(glue)
            rendered = header
        text = render(tokenizer, messages[: i + 1], tools, add_generation_prompt=False)
        if not text.startswith(rendered):
            raise ValueError(f"chat template does not render message {i} as an extension of the ones before it")
        plain = tool_spans(tokenizer, messages[: i + 1], tools, False, text) if is_tool_output(message) else []
        piece, _ = encode_text(tokenizer, text, plain, start=len(rendered))
        if message["role"] == "assistant":
            # Trained: everything up to and including the end-of-turn token (before it, for a code action: the policy
            # stopped on </code>); the template's trailing glue is not.
            end = len(piece)
            while end > 0 and piece[end - 1] != eot_id:
                end -= 1
            if end > 0 and is_action_turn(messages, i):
                end -= 1
            mask += [1] * end + [0] * (len(piece) - end)
        else:
            mask += [0] * len(piece)
        ids += piece
        rendered = text
    return ids, mask


def tool_spans(tokenizer, messages: list[dict], schemas: list[dict] | None, add_generation_prompt: bool, text: str,
               first: int = 0) -> list[tuple[int, int]]:
    """Character spans in `text`, the template's rendering of `messages`, of the tool outputs (text parts of tool and
    observation messages from index `first` on) that hold a special token's text; each found by rendering its message
    with that text replaced by a marker. Outputs without special-token text need no span: they tokenize the same
    either way."""
    specials = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    spans = []
    for k in range(first, len(messages)):
        message = messages[k]
        if not is_tool_output(message):
            continue
        content = message["content"]
        texts = [content] if isinstance(content, str) else [p.get("text", "") for p in content]
        for j, part_text in enumerate(texts):
            if not any(t in (part_text or "") for t in specials):
                continue
            marked = {**message, "content": TOOL_OUTPUT_MARK if isinstance(content, str) else [
                {**p, "text": TOOL_OUTPUT_MARK} if n == j else p for n, p in enumerate(content)]}
            head, _, tail = render(tokenizer, messages[:k] + [marked] + messages[k + 1 :], schemas,
                                   add_generation_prompt).partition(TOOL_OUTPUT_MARK)
            if TOOL_OUTPUT_MARK in tail or len(head) + len(tail) > len(text) or not (
                    text.startswith(head) and text.endswith(tail)):
                raise ValueError(f"the chat template does not render the output of tool message {k} where its marker "
                                 "goes")
            spans.append((len(head), len(text) - len(tail)))
    return spans


def is_tool_output(message: dict) -> bool:
    """A tool's reply: a `tool` message, or a tag-protocol observation (a user turn opening with <sandbox_output>)."""
    return message["role"] == "tool" or (message["role"] == "user" and
                                         _content_text(message["content"]).startswith(OBSERVATION_OPEN))


def is_code_action(text: str) -> bool:
    """Whether an assistant turn's text is a tag-protocol action: it ends on </code> (whitespace aside) and gives no
    <answer>."""
    return CODE_STOP in text and not text.rsplit(CODE_STOP, 1)[1].strip() and ANSWER_OPEN not in text


def is_action_turn(messages: list[dict], i: int) -> bool:
    """Whether assistant message i is a code action answered by an observation: its end-of-turn token was not sampled
    (generation stopped on </code>) but written by the rollout."""
    return (messages[i]["role"] == "assistant" and is_code_action(_content_text(messages[i]["content"]))
            and i + 1 < len(messages) and messages[i + 1]["role"] == "user" and is_tool_output(messages[i + 1]))


def stop_cut(tokenizer, ids: list[int], stops: list[str]) -> tuple[int, str, str] | None:
    """(tokens to keep, text before the stop string, the stop string) at the earliest of the `stops` in the decoded
    ids, or None: the ids are kept up to the token that completes it (a token may hold more text after it: the ids
    stay as sampled). The first prefix whose decoding holds that stop string is found by bisection (a prefix's decoding
    keeps what it holds as tokens are added; decoding every prefix is quadratic)."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    found = [(text.find(s), s) for s in stops if s in text]
    if not found:
        return None
    at, stop = min(found)
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        if tokenizer.decode(ids[:mid], skip_special_tokens=False).startswith(stop, at):
            high = mid
        else:
            low = mid + 1
    return low, text[:at], stop


def code_stop(tokenizer, ids: list[int]) -> int | None:
    """How many of the generated `ids` to keep when generation stops on </code> (stop_cut), or None when there is
    none."""
    cut = stop_cut(tokenizer, ids, [CODE_STOP])
    return None if cut is None else cut[0]


def parse_code_action(text: str) -> list[dict | str]:
    """The call a tag-protocol action asks for: [{"name": "python", "arguments": {"code"}}] from the last <code> block
    (``` fences taken off), [an error message] for a </code> without <code>, [] for a turn that is no action."""
    if not is_code_action(text):
        return []
    _, opened, body = text.rsplit(CODE_STOP, 1)[0].rpartition(CODE_OPEN)
    if not opened:
        return ["Error: </code> without an opening <code>; write <code>```python\n...\n```</code>"]
    fenced = CODE_FENCE.search(body) if "```" in body else None
    code = textwrap.dedent(fenced.group(1) if fenced else body).strip("\n")
    return [{"name": "python", "arguments": {"code": code}}]


def observation_message(text: str, n_images: int) -> dict:
    """The sandbox's reply to a code action as the user turn that carries it: <sandbox_output>text, then an image part
    per image, then </sandbox_output>."""
    return {"role": "user", "content": [{"type": "text", "text": OBSERVATION_OPEN + text + ("\n" if n_images else "")},
                                        *[{"type": "image"}] * n_images, {"type": "text", "text": OBSERVATION_CLOSE}]}


def image_pad_id(tokenizer) -> int | None:
    """The id of the image placeholder the chat template writes per image (<|image_pad|>), None if it has none."""
    return tokenizer.get_vocab().get(IMAGE_PAD)


def encode_text(tokenizer, text: str, plain: list[tuple[int, int]],
                start: int = 0) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character offsets (into `text`) of text[start:] as the tokenizer makes them, except that special tokens
    inside the character spans `plain` are ordinary text: a tool cannot end a turn or open one by printing the
    template's tokens. The tokenizer splits at special tokens anyway, so outside those spans nothing changes."""
    encoded = tokenizer(text[start:], add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], [(a + start, b + start) for a, b in encoded["offset_mapping"]]
    if not plain:
        return ids, offsets
    special = special_ids(tokenizer)
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


def rendering_key(tokenizer, schemas: list[dict] | None) -> str | None:
    """A digest of everything that decides the ids `render` then the tokenizer give a conversation: the tokenizer
    itself as loaded (its serialized vocabulary, merges, normalizer and added tokens, whichever files they came
    from), its chat template and special tokens, the tool signatures, and the libraries' versions. None for a
    tokenizer without a serialized form (a slow, pure-Python one): then nothing derived from it can be cached."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    parts = [type(tokenizer).__name__, version("transformers"), version("tokenizers"), version("jinja2"),
             backend.to_str(), tokenizer.chat_template, tokenizer.special_tokens_map, schemas]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def template_suffix_ids(tokenizer, messages: list[dict], new_messages: list[dict],
                        schemas: list[dict] | None, eot: str | None = None, after_eot: bool = True) -> list[int]:
    """Ids the chat template appends after a trajectory that ends on its last assistant turn's end-of-turn token `eot`
    (default: end_of_turn's), for `new_messages` plus the next assistant header: the template's glue after that token,
    then the new ones (tool output tokenized as plain text). after_eot=False: the trajectory ends right before that
    token (a code action stopped on </code>), so the ids start with it. Rendered after the conversation's `window`:
    a turn costs the same at turn 90 as at turn 2."""
    eot = eot or end_of_turn(tokenizer)
    context = window(tokenizer, messages, schemas)
    after, cut = _suffix_text(tokenizer, context, new_messages, schemas, eot, after_eot)
    plain = tool_spans(tokenizer, context + new_messages, schemas, True, after, first=len(context))
    return encode_text(tokenizer, after, plain, start=cut)[0]


def _suffix_text(tokenizer, messages: list[dict], new_messages: list[dict], schemas: list[dict] | None, eot: str,
                 after_eot: bool) -> tuple[str, int]:
    """The rendering of `messages` + `new_messages` with the next assistant header, and where in it the trajectory
    that ends on the last assistant turn of `messages` ends."""
    before = render(tokenizer, messages, schemas, add_generation_prompt=False)
    after = render(tokenizer, messages + new_messages, schemas, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template does not render the new messages as an extension of the conversation")
    return after, before.rindex(eot) + (len(eot) if after_eot else 0)


def window(tokenizer, messages: list[dict], schemas: list[dict] | None) -> list[dict]:
    """`messages` cut to what the chat template needs to render what it appends after them: the first message (a
    template asks whether a conversation opens with a system prompt) and the last SUFFIX_WINDOW, where the template
    renders each message from its neighbours alone (`renders_locally`); else all of them."""
    if len(messages) <= SUFFIX_WINDOW + 1 or not renders_locally(tokenizer, schemas):
        return messages
    return messages[:1] + messages[-SUFFIX_WINDOW:]


def renders_locally(tokenizer, schemas: list[dict] | None) -> bool:
    """Whether the chat template appends the same text after an assistant turn (for one tool result, two, or a user
    message) when the conversation before it is rendered whole as when only its window is: probed on LOCALITY_PROBE
    once per tokenizer and tool signatures. A template that numbers images or turns across the conversation, or
    renders a message from far-away ones, is not local: its suffixes are rendered after the whole history.
    check_tito, which renders the whole conversation, would show any drift."""
    known = _locality.setdefault(tokenizer, {})
    key = json.dumps(schemas, sort_keys=True)
    if key not in known:
        eot, probe, local = end_of_turn(tokenizer), LOCALITY_PROBE, True
        news = ([{"role": "tool", "content": "new output"}],
                [{"role": "tool", "content": "new output"}, {"role": "tool", "content": "more output"}],
                [{"role": "user", "content": "new request"}])
        try:
            for i in (i for i, m in enumerate(probe) if m["role"] == "assistant" and i > SUFFIX_WINDOW):
                for new in news:
                    whole, cut = _suffix_text(tokenizer, probe[: i + 1], new, schemas, eot, True)
                    part, part_cut = _suffix_text(tokenizer, probe[:1] + probe[i + 1 - SUFFIX_WINDOW: i + 1], new,
                                                  schemas, eot, True)
                    local = local and whole[cut:] == part[part_cut:]
        except Exception:  # a template that cannot render the probe's turns: never windowed
            local = False
        known[key] = local
    return known[key]


def truncate_tool_text(tokenizer, text: str, max_tokens: int) -> tuple[str, bool]:
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]  # as it will be encoded
    if len(ids) <= max_tokens:
        return text, False
    return tokenizer.decode(ids[:max_tokens]) + f"\n[... truncated {len(ids) - max_tokens} tokens]", True


def shown(tokenizer, ids: list[int]) -> str:
    """Token ids and their text for a console line: the text as ASCII (escapes for control characters, the partial
    UTF-8 of a byte-level token and any other non-ASCII), so a drift report never writes raw bytes to a terminal."""
    return f"{ids} {ascii(tokenizer.decode(ids))}"


def mask_drifted(findings: dict[str, str]) -> bool:
    """Whether check_tito's findings go beyond a sampled split of the template's text: a loss mask that would train
    other tokens than the assistant's, or other text."""
    return bool(findings.keys() - {"ids"})


def decoded_offsets(tokenizer, ids: list[int], text: str) -> list[tuple[int, int]] | None:
    """Character offsets in `text` of each of `ids`, a tokenization of it that need not be the tokenizer's own; None
    when the ids do not decode to `text`. A token's characters are what it adds to the decoding of the few tokens
    before it, so the work is linear in the ids (decoding every prefix would be quadratic)."""
    def decoded(start: int, stop: int) -> str:
        return tokenizer.decode(ids[start:stop], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    if decoded(0, len(ids)) != text:
        return None
    offsets, end = [], 0
    for n in range(1, len(ids) + 1):
        start = max(0, n - 1 - DECODE_CONTEXT)
        begin, end = end, end + len(decoded(start, n)) - len(decoded(start, n - 1))
        offsets.append((begin, end))
    return offsets


def assistant_places(tokenizer, messages: list[dict], tools: list[dict] | None, eot: str,
                     text: str) -> dict[int, tuple[int, int]]:
    """Where each assistant message's content begins and its end-of-turn token `eot` is in `text`, the template's
    rendering of `messages`: {message index: (begin, end)}. Each turn is placed from the previous one by rendering its
    window (`template_suffix_ids`'s), so the work is linear in the conversation, and checked against `text`; where the
    windows disagree with the whole rendering, every turn is placed by rendering all the messages before it."""
    try:
        places = _places_by_windows(tokenizer, messages, tools, eot, text)
    except ValueError:  # a template that does not render a turn as an extension of the ones before it
        places = None
    if places is None:
        places = {i: (len(render(tokenizer, messages[:i], tools, add_generation_prompt=True)),
                      render(tokenizer, messages[: i + 1], tools, add_generation_prompt=False).rindex(eot))
                  for i, m in enumerate(messages) if m["role"] == "assistant"}
    return places


def _places_by_windows(tokenizer, messages: list[dict], tools: list[dict] | None, eot: str,
                       text: str) -> dict[int, tuple[int, int]] | None:
    places, previous = {}, None  # previous: (index, where its end-of-turn token is)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context = window(tokenizer, messages[:i], tools)
        header = render(tokenizer, context, tools, add_generation_prompt=True)
        closed = render(tokenizer, context + [message], tools, add_generation_prompt=False)
        if previous is None:  # the first turn: what comes before it is rendered whole
            begin = len(render(tokenizer, messages[:i], tools, add_generation_prompt=True))
        else:
            j, at = previous
            glue, cut = _suffix_text(tokenizer, window(tokenizer, messages[: j + 1], tools), messages[j + 1: i], tools,
                                     eot, True)
            begin = at + len(eot) + len(glue) - cut
        end = begin + closed.rindex(eot) - len(header)
        if not (closed.startswith(header) and text[begin:end] == closed[len(header): closed.rindex(eot)]
                and text.startswith(eot, end)):
            return None
        places[i], previous = (begin, end), (i, end)
    return places


def check_tito(tokenizer, sample, messages: list[dict], tools: list[dict] | None = None,
               eot: str | None = None, open_turns=()) -> dict[str, str]:
    """Drift between a trajectory (a rollout.Sample, or anything with its ids, prompt_ids and loss_mask) and the chat
    template's rendering of the same messages (tokenized whole, tool output as plain text): ids that differ, and
    loss-mask positions that are not exactly the assistant turns' content plus the token that closed them where the
    policy sampled it: the end-of-turn token `eot` (default: end_of_turn's), or for the last turn any special token it
    stopped on. Not after a code action, nor after the assistant messages whose indices are in `open_turns`: replies
    cut by a token budget or a stop string, closed by the template. A last reply cut by the trajectory's own budget
    (the sample's finish_reason "max_total_tokens", no stop token) is half a turn, kept but not trained: it has no
    span. When the ids are another split of the same text,
    the mask is still checked, on the trajectory's own tokens. Returns the findings by kind, each with a readable
    detail: "ids" (another split of the text), "text" (other text) and "mask" (a loss mask drift); {} = no drift."""
    eot = eot or end_of_turn(tokenizer)
    text = whole = render(tokenizer, messages, tools, add_generation_prompt=False)
    plain = tool_spans(tokenizer, messages, tools, False, text)
    # A trajectory that ends on an assistant turn ends on the policy's last token: a special token it stopped on (the
    # template's end-of-turn, or another such as <|endoftext|>), or the token before where the template would close
    # the turn (stopped on </code>, or cut by a limit).
    ends_on_assistant = messages[-1]["role"] == "assistant"
    stop = sample.ids[-1] if ends_on_assistant and sample.ids and sample.ids[-1] in special_ids(tokenizer) else None
    stop_text = "" if stop is None else tokenizer.convert_ids_to_tokens(stop)
    if ends_on_assistant:
        text = text[: text.rindex(eot)] + stop_text
    want, offsets = encode_text(tokenizer, text, plain)
    findings = {}
    got = sample.ids
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if first < max(len(got), len(want)):
        findings["ids"] = (f"ids drift at token {first} of {len(got)} (template: {len(want)} tokens): trajectory "
                           f"{shown(tokenizer, got[first:first + 8])} vs template "
                           f"{shown(tokenizer, want[first:first + 8])}")
        # A sampled split of the same text (the policy may spell "x /" as two tokens where the tokenizer makes one)
        # still has a loss mask to check, against its own tokens' places in the text.
        offsets = decoded_offsets(tokenizer, got, text)
        if offsets is None:
            findings["text"] = "text drift: the trajectory's ids do not decode to the template's rendering"
            return findings
    half_turn = (ends_on_assistant and stop is None and getattr(sample, "finish_reason", "") == "max_total_tokens"
                 and not is_code_action(_content_text(messages[-1]["content"])))  # (a whole action: its </code>)
    spans = []  # character spans of each assistant turn: content + the token that closed it if the policy sampled it
    for i, (begin, end) in assistant_places(tokenizer, messages, tools, eot, whole).items():
        last = i == len(messages) - 1
        if last and half_turn:
            continue
        unsampled = is_action_turn(messages, i) or i in open_turns or (last and stop is None)
        spans.append((begin, end + (0 if unsampled else len(stop_text if last else eot))))
    # The prompt is never trained, assistant turns in it (a conversation resumed from its messages) included.
    want_mask, span = [], 0  # one sweep: tokens and spans both run left to right
    for k, (s, e) in enumerate(offsets):
        while span < len(spans) and spans[span][1] < e:
            span += 1
        want_mask.append(int(k >= len(sample.prompt_ids) and span < len(spans) and spans[span][0] <= s))
    mask = [0] * len(sample.prompt_ids) + list(sample.loss_mask)
    wrong = [i for i, (a, b) in enumerate(zip(mask, want_mask)) if a != b]
    if wrong:
        findings["mask"] = (f"loss mask drift at {len(wrong)} tokens, first {wrong[0]} "
                            f"({shown(tokenizer, got[wrong[0]:wrong[0] + 1])}: mask {mask[wrong[0]]}, "
                            f"want {want_mask[wrong[0]]})")
    return findings
