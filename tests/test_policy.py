"""policy.py and checkpoint.py: tiny model + tokenizer, chat template, packed chunked logprobs, checkpoints; the FSDP2
checks run in one torchrun launch (tests/dist_policy.py)."""

import collections
import copy
import filecmp
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch.nn.attention.flex_attention import create_mask
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import engines
import policy
import ranks
import tiny
from checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CORPUS = [inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap, inspect)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS, seed=3)


@pytest.fixture(scope="module")
def model(model_dir):
    return policy.load_model(model_dir)


def test_tiny_model_is_deterministic_and_qwen_shaped(model_dir, tmp_path):
    again = tiny.make_tiny_model(tmp_path, CORPUS, seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json", "model.safetensors"):
        assert filecmp.cmp(model_dir / name, again / name, shallow=False), name
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["tie_word_embeddings"]) == (2, 64, True)
    assert (config["eos_token_id"], config["pad_token_id"]) == (2, 0)
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    model = policy.load_model(model_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.vocab_size == len(policy.load_tokenizer(model_dir))


def test_tokenizer_round_trips_code_and_knows_the_agent_tokens(model_dir):
    tokenizer = policy.load_tokenizer(model_dir)
    assert tokenizer.padding_side == "left"
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    assert tokenizer.convert_tokens_to_ids(specials) == [0, 1, 2, 3, 4, 5]
    assert policy.stop_token_ids(tokenizer, model_dir) == [2, 0]
    codes = [inspect.getsource(subprocess.Popen.communicate),
             "def f(x):\n\tif x:\r\n    return '  ünïcødé → λ 🙂'\n\n\n",
             "   leading and trailing   \n", "a = [1,2 ,3]  # <tool_call> inside code </tool_call>\x00\x7f", ""]
    for code in codes:
        ids = tokenizer.encode(code)
        assert tokenizer.decode(ids) == code
    for token in ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]:
        (token_id,) = tokenizer.encode(token)
        assert token_id >= 6 and tokenizer.decode([token_id], skip_special_tokens=True) == token  # not special
    assert len(tokenizer.encode(CORPUS[1])) < len(CORPUS[1].encode()) / 2  # the BPE merges learned something


def test_chat_template_renders_tool_calls_and_grouped_tool_responses(model_dir):
    tokenizer = policy.load_tokenizer(model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Run it."},
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"type": "function", "function": {"name": "python", "arguments": {"code": "print(1)"}}},
            {"type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "a.py"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "python", "arguments": {}}}]},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nRun it.<|im_end|>\n"
        "<|im_start|>assistant\nSure.\n<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"print(1)\"}}\n"
        "</tool_call>\n<tool_call>\n{\"name\": \"ls\", \"arguments\": {\"path\": \".\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\na.py\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"python\", \"arguments\": {}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nDone.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>And this?<|im_end|>\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == expected[: expected.index("<|im_start|>assistant")] + "<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids) == expected and ids.count(tokenizer.convert_tokens_to_ids("<tool_call>")) == 3
    with_tools = tokenizer.apply_chat_template(messages[:2], tools=[{"name": "python"}], tokenize=False)
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '\n{"name": "python"}\n' in with_tools
    assert with_tools.count("<|im_start|>system") == 1 and with_tools.endswith("<|im_start|>user\nRun it.<|im_end|>\n")


SEQUENCES = [[1, 40, 41, 42, 43, 44, 45, 2], [7, 8], [300, 301, 17, 250, 9], [11]]


def naive_logprobs(model, sequences, temperature=1.0, packed=True, position_ids=True):
    """Full [tokens, vocab] log_softmax (the thing packed_logprobs avoids), as flat aligned outputs."""
    if packed:
        ids = torch.tensor([[t for s in sequences for t in s]])
        positions = torch.cat([torch.arange(len(s)) for s in sequences])[None] if position_ids else None
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0].float() / temperature
        rows = torch.split(logits, [len(s) for s in sequences])
    else:
        rows = [model(input_ids=torch.tensor([s])).logits[0].float() / temperature for s in sequences]
    lps, ents = [], []
    for s, z in zip(sequences, rows):
        logp = z.log_softmax(-1)
        lps += [logp.new_zeros(1), logp[:-1].gather(1, torch.tensor(s[1:])[:, None]).squeeze(1)]
        ents += [logp.new_zeros(1), -(logp.exp() * logp).sum(-1)[:-1]]
    return torch.cat(lps), torch.cat(ents)


def test_packed_equals_per_sequence_forwards(model):
    with torch.no_grad():
        lp, ent = policy.packed_logprobs(model, SEQUENCES, with_entropy=True)
        separate_lp, separate_ent = naive_logprobs(model, SEQUENCES, packed=False)
        unmasked_lp, _ = naive_logprobs(model, SEQUENCES, position_ids=False)
    assert lp.shape == (sum(map(len, SEQUENCES)),) and lp.dtype == torch.float32
    torch.testing.assert_close(lp, separate_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, separate_ent, atol=1e-5, rtol=0)
    # Without restarting positions the sequences would attend to each other: the test can tell.
    assert (unmasked_lp - separate_lp).abs().max() > 1e-3
    starts = [0, 8, 10, 15]
    assert lp[starts].eq(0).all() and ent[starts].eq(0).all() and (lp[1:8] < 0).all()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_equals_naive_including_gradients(model_dir, temperature, dtype, tolerance):
    """fp64 shows the chunked math is the naive math (1e-6 is far above fp64 rounding); fp32 shows rounding stays
    small in the dtype training uses (absolute for logprobs, relative to each tensor's largest entry otherwise)."""
    weights = torch.randn(sum(map(len, SEQUENCES)), generator=torch.Generator().manual_seed(0), dtype=dtype)
    results = []
    for method in ("chunked", "naive"):
        model = policy.load_model(model_dir, dtype=dtype)
        if method == "chunked":
            lp, ent = policy.packed_logprobs(model, SEQUENCES, temperature, chunk_size=3, with_entropy=True)
        else:
            lp, ent = naive_logprobs(model, SEQUENCES, temperature)
        ((weights * lp).sum() + (weights.flip(0) * ent).sum()).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append({"logprobs": lp.detach(), "entropy": ent.detach()} | grads)
    chunked, naive = results
    assert chunked["logprobs"].dtype == dtype and chunked.keys() == naive.keys()
    assert (chunked["logprobs"] - naive["logprobs"]).abs().max() <= tolerance
    for name, value in naive.items():
        assert (chunked[name] - value).abs().max() <= tolerance * max(1.0, value.abs().max()), name
    assert naive["model.embed_tokens.weight"].abs().sum() > 0


def test_temperature_and_entropy_by_hand(model):
    sequence = [5, 60, 61, 62]
    with torch.no_grad():
        cold, cold_ent = policy.packed_logprobs(model, [sequence], temperature=0.5, with_entropy=True)
        warm, _ = policy.packed_logprobs(model, [sequence], temperature=1.0)
        z = model(torch.tensor([sequence])).logits[0, 1].double() / 0.5  # predicts token 61 after [5, 60]
    p = torch.softmax(z, -1)
    assert abs(cold[2].item() - torch.log(p[61]).item()) < 1e-5
    assert abs(cold_ent[2].item() - (-(p * p.log()).sum()).item()) < 1e-5
    assert (cold - warm).abs().max() > 1e-3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_packed_sdpa_equals_sdpa_including_gradients(model_dir, device):
    """packed_sdpa (each packed sequence attended on its own, no block-diagonal mask) computes what sdpa with the mask
    computes: per-sequence forwards' values, and the same gradients (the tiny model has grouped KV heads, 4 and 2)."""
    results = {}
    for attn in ("sdpa", "packed_sdpa"):
        model = policy.load_model(model_dir, attn_implementation=attn).to(device)
        lp, ent = policy.packed_logprobs(model, SEQUENCES, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
        results[attn] = [lp.detach(), ent.detach()] + [p.grad for p in model.parameters()]
    for got, want in zip(results["packed_sdpa"], results["sdpa"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    if device == "cpu":
        with torch.no_grad():
            separate_lp, _ = naive_logprobs(model, SEQUENCES, packed=False)
        torch.testing.assert_close(results["packed_sdpa"][0], separate_lp, atol=1e-5, rtol=0)


def test_packed_sdpa_refuses_what_it_cannot_attend(model_dir):
    """A KV cache, padded rows or positions that do not start at 0 would be attended wrongly: a clear error instead."""
    model = policy.load_model(model_dir, attn_implementation="packed_sdpa")
    with torch.no_grad(), pytest.raises(ValueError, match="packed forwards only"):
        model.generate(torch.tensor([[1, 40, 41]]), max_new_tokens=2, do_sample=False)
    with torch.no_grad(), pytest.raises(ValueError, match="packed forwards only"):
        model(input_ids=torch.tensor([[1, 40], [1, 41]]), position_ids=torch.tensor([[0, 1], [0, 1]]))
    with torch.no_grad(), pytest.raises(ValueError, match="start at 0"):
        model(input_ids=torch.tensor([[1, 40, 41]]), position_ids=torch.tensor([[3, 4, 5]]), use_cache=False)
    config = copy.deepcopy(model.config)
    config.update(dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"]))
    windowed = type(model)._from_config(config, attn_implementation="packed_sdpa")
    with torch.no_grad(), pytest.raises(ValueError, match="sliding window of 4"):
        policy.packed_logprobs(windowed, SEQUENCES)


def test_score_from_scores_only_completions(model, monkeypatch):
    """score_from = prompt lengths: the same logprobs, entropies and gradients on the scored tokens, 0 before them,
    and the output layer runs on the scored positions only."""
    score_from = [5, 1, 4, 1]  # the last sequence has one token: nothing to score either way
    head_rows = []
    chunked = policy._ChunkedChosenLogprobs.apply
    monkeypatch.setattr(policy._ChunkedChosenLogprobs, "apply",
                        lambda hidden, *a: head_rows.append(hidden.shape[0]) or chunked(hidden, *a))
    results = []
    for kwargs in ({}, {"score_from": score_from}):
        model.zero_grad()
        lp, ent = policy.packed_logprobs(model, SEQUENCES, with_entropy=True, **kwargs)
        scored = torch.cat([torch.arange(len(s)) >= f for s, f in zip(SEQUENCES, score_from)])
        (lp[scored].sum() + ent[scored].sum()).backward()
        results.append((lp.detach(), ent.detach(), scored, [p.grad.clone() for p in model.parameters()]))
    model.zero_grad()
    (full_lp, full_ent, scored, full_grads), (lp, ent, _, grads) = results
    assert head_rows == [sum(len(s) - 1 for s in SEQUENCES), sum(len(s) - f for s, f in zip(SEQUENCES, score_from))]
    assert scored.sum() == 5 and lp[~scored].eq(0).all() and ent[~scored].eq(0).all()
    torch.testing.assert_close(lp[scored], full_lp[scored], atol=1e-6, rtol=0)
    torch.testing.assert_close(ent[scored], full_ent[scored], atol=1e-6, rtol=0)
    for got, want in zip(grads, full_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for bad in ([1, 1, 1], [0, 1, 1, 1], [1, 3, 1, 1]):
        with pytest.raises(ValueError, match="score_from"):
            policy.packed_logprobs(model, SEQUENCES, score_from=bad)


PROMPT_A, PROMPT_B = [1, 40, 41, 42, 43], [1, 300, 301]
# Two groups, interleaved. B's first sample has an empty completion, so the branch after it continues its positions
# without a break (packed_sdpa reads one run: prompt + that branch, which is that sequence) and the next one branches.
GROUPED = [PROMPT_A + [7, 8, 9], PROMPT_B, PROMPT_A + [250, 9], PROMPT_B + [17], PROMPT_A + [44, 45, 2],
           PROMPT_B + [9, 9], PROMPT_A + [11, 12, 13]]
GROUPED_FROM = [len(PROMPT_A) if s[1] == 40 else len(PROMPT_B) for s in GROUPED]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_shared_prefixes_run_once_and_change_nothing(model_dir, monkeypatch, device):
    """share_prefixes: each group's prompt enters the forward once and its completions attend to it as branches;
    logprobs, entropies and gradients are those of separate per-sequence forwards. A model whose attention cannot
    share (sdpa) gets every sequence whole, with the same numbers."""
    rows = []
    embed = torch.nn.Embedding.forward
    monkeypatch.setattr(torch.nn.Embedding, "forward", lambda self, ids: rows.append(ids.shape[-1]) or embed(self, ids))
    results = {}
    for attn, share in (("packed_sdpa", False), ("packed_sdpa", True), ("sdpa", True)):
        model = policy.load_model(model_dir, attn_implementation=attn).to(device)
        assert policy.shares_prefixes(model) == (attn == "packed_sdpa")
        lp, ent = policy.packed_logprobs(model, GROUPED, with_entropy=True, score_from=GROUPED_FROM,
                                         share_prefixes=share)
        (lp.sum() + 0.5 * ent.sum()).backward()
        results[attn, share] = (lp.detach().cpu(), ent.detach().cpu(), [p.grad.cpu() for p in model.parameters()])
    total = sum(map(len, GROUPED))
    distinct_prefixes = len({tuple(s[:k]) for s in GROUPED for k in range(1, len(s) + 1)})  # each prompt once, and
    assert rows == [total, distinct_prefixes, total]  # the token both prompts start with too (a prefix tree)
    with torch.no_grad():
        separate_lp, separate_ent = naive_logprobs(policy.load_model(model_dir), GROUPED, packed=False)
    scored = torch.cat([torch.arange(len(s)) >= f for s, f in zip(GROUPED, GROUPED_FROM)])
    want_lp, want_ent, want_grads = results["packed_sdpa", False]
    torch.testing.assert_close(want_lp[scored], separate_lp[scored], atol=1e-5, rtol=0)
    torch.testing.assert_close(want_ent[scored], separate_ent[scored], atol=1e-5, rtol=0)
    for key in (("packed_sdpa", True), ("sdpa", True)):
        lp, ent, grads = results[key]
        assert lp[~scored].eq(0).all() and ent[~scored].eq(0).all()
        torch.testing.assert_close(lp, want_lp, atol=1e-6, rtol=0)
        torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=0)
        for got, want in zip(grads, want_grads):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_shared_prefix_layout_is_what_packed_sdpa_reads():
    """The packed row of two groups, a prefix tree in pre-order: the sequences sorted, each laid out from where it
    leaves the one before it, its positions continuing from there ([9, 1, 2] extends [9, 1] without a break); each
    scored token is predicted by its own sequence's previous token, wherever the tree holds it."""
    ids, positions, source, dest, pieces = policy._layout([[5, 6, 7, 8], [9, 1], [5, 6, 3], [9, 1, 2]], [2, 1, 2, 1],
                                                          True)
    assert ids == [5, 6, 3, 7, 8, 9, 1, 2]
    assert pieces == [(2, 0), (0, 2), (1, 0), (3, 2)]  # (sequence, its first token laid out)
    assert positions == [0, 1, 2, 2, 3, 0, 1, 2]
    #                   scored tokens: 3 | 7, 8 | 1 | 1, 2 (concatenated index 8 | 2, 3 | 5 | 10, 11)
    assert dest == [8, 2, 3, 5, 10, 11]
    assert source == [1, 1, 3, 5, 5, 6]
    assert [ids[j] for j in source] == [6, 6, 7, 9, 9, 1]


def test_shared_prefixes_in_the_value_model(model_dir):
    """packed_values with score_from and share_prefixes: on the scored positions the values and gradients of
    separate per-sequence forwards, 0 before them."""
    results = []
    for share in (False, True):
        critic = policy.load_value_model(model_dir, attn_implementation="packed_sdpa")
        torch.manual_seed(0)
        torch.nn.init.normal_(critic.score.weight)  # a fresh critic's head is 0: every value would be
        values = policy.packed_values(critic, GROUPED, score_from=GROUPED_FROM, share_prefixes=share)
        values.square().sum().backward()
        results.append((values.detach(), [p.grad for p in critic.parameters()]))
    with torch.no_grad():
        separate = torch.cat([torch.cat([torch.zeros(1), critic(input_ids=torch.tensor([s])).logits[0, :-1, 0]])
                              for s in GROUPED])
    scored = torch.cat([torch.arange(len(s)) >= f for s, f in zip(GROUPED, GROUPED_FROM)])
    (want, want_grads), (got, grads) = results
    assert got[~scored].eq(0).all() and want[~scored].eq(0).all()
    torch.testing.assert_close(want[scored], separate[scored], atol=1e-5, rtol=0)
    # Values reach several units (a random head): the shared prompt's attention sums in another order, so relative.
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for g, w in zip(grads, want_grads):  # to each tensor's scale: a shared prompt's gradient sums in another order
        torch.testing.assert_close(g, w, atol=1e-5 * w.abs().max().item(), rtol=0)


def test_pack_counts_a_shared_prompt_once_per_micro_batch(model_dir):
    """Samples 10-12 share a 6-token prompt, sample 13 has its own: under packed_sdpa 10-12 fit one micro-batch of 20
    tokens (10 + 4 + 4), under sdpa every sample counts whole. A sample opening a micro-batch pays its prompt again."""
    shares, whole = (policy.load_model(model_dir, attn_implementation=a) for a in ("packed_sdpa", "sdpa"))
    prompt = [1, 2, 3, 4, 5, 6]
    sequences = [prompt + [7, 8, 9, 10], prompt + [11, 12, 13, 14], prompt + [15, 16, 17, 18], [9] * 6 + [1, 2]]
    index, first = [10, 11, 12, 13], [6, 6, 6, 6]
    assert policy.pack(index, sequences, 20, first, whole) == [[10, 11], [12, 13]]
    assert policy.pack(index, sequences, 20, first, shares) == [[10, 11, 12], [13]]
    assert policy.pack(index, sequences, 13, first, shares) == [[10], [11], [12], [13]]
    assert policy.pack(index, sequences, 14, first, shares) == [[10, 11], [12], [13]]


def test_branch_block_mask_says_what_packed_sdpa_attends():
    """The flex mask of the layout above, token by token: a sequence's first run is causal, a branch sees its prefix
    (the first p tokens of its sequence) and itself, nothing crosses sequences or other branches."""
    positions = torch.tensor([0, 1, 2, 3, 2, 0, 1, 1, 2])  # [5, 6, 7, 8] + branch [3] | [9, 1] + branch [1, 2]
    mask = policy.branch_block_mask(positions)
    dense = create_mask(mask.mask_mod, None, None, 9, 9, device="cpu")[0, 0]
    want = torch.zeros(9, 9, dtype=torch.bool)
    for q, visible in enumerate([[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 4], [5], [5, 6], [5, 7], [5, 7, 8]]):
        want[q, visible] = True
    assert torch.equal(dense, want), dense.int()


@pytest.mark.slow  # flex_attention compiles (about 15 s on the 2-core CPU)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_flex_attention_shares_prefixes_through_a_block_mask(model_dir, device):
    """flex_attention alone would read each branch as a sequence of its own; packed_logprobs hands it the branch
    mask, and the numbers are the unshared ones: logprobs and entropies, and on a GPU the gradients too (flex has no
    backward on CPU)."""
    model = policy.load_model(model_dir, attn_implementation="flex_attention").to(device)
    train = device == "cuda"
    results = []
    for share in (False, True):
        model.zero_grad()
        with torch.set_grad_enabled(train):
            lp, ent = policy.packed_logprobs(model, GROUPED, with_entropy=True, score_from=GROUPED_FROM,
                                             share_prefixes=share)
        if train:
            (lp.sum() + 0.5 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()] if train else []))
    (want_lp, want_ent, want_grads), (lp, ent, grads) = results
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_flex_attention_always_runs_its_main_kernel(model_dir, monkeypatch):
    """Compiled, a forward-only flex_attention with under 128 query tokens (a checkpointed layer's forward, a short
    row) would run inductor's flex_decoding kernel, whose logprobs disagree with eager ones on CUDA (bench/RESULTS.md):
    both packed forwards ask every flex_attention call for the main kernel."""
    seen = []

    def recording(module, query, key, value, attention_mask, **kwargs):  # what each call asks, not its numbers
        seen.append(kwargs.get("kernel_options"))
        return torch.zeros_like(query).transpose(1, 2), None

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flex_attention", recording)
    with torch.no_grad():
        policy.packed_logprobs(policy.load_model(model_dir, attn_implementation="flex_attention"), SEQUENCES)
        policy.packed_values(policy.load_value_model(model_dir, attn_implementation="flex_attention"), SEQUENCES)
    layers = policy.load_model(model_dir).config.num_hidden_layers
    assert seen == [{"FORCE_USE_FLEX_ATTENTION": True}] * (2 * layers)


def test_minibatches_take_whole_groups():
    groups = [7, 7, 7, 3, 3, 3, 9, 9, 9, 4, 4, 4]  # group ids need not be ordered, only adjacent
    assert [policy.minibatch(groups, 2, k) for k in range(2)] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert [policy.minibatch(groups[:9], 2, k) for k in range(2)] == [[0, 1, 2], [3, 4, 5, 6, 7, 8]]
    assert [policy.minibatch(groups[:5], 3, k) for k in range(3)] == [[], [0, 1, 2], [3, 4]]
    assert policy.minibatch(groups, 1, 0) == list(range(12))
    assert policy.minibatch([], 2, 1) == []


def test_packed_sdpa_refuses_a_branch_past_its_prefix(model_dir):
    """A run of positions starting at 4 after a sequence of 3 tokens would attend to a prefix that is not there."""
    model = policy.load_model(model_dir, attn_implementation="packed_sdpa")
    with torch.no_grad(), pytest.raises(ValueError, match="positions 4.. continue a sequence whose first 3 tokens"):
        model(input_ids=torch.tensor([[1, 40, 41, 42, 43]]), position_ids=torch.tensor([[0, 1, 2, 4, 5]]),
              use_cache=False)


def test_packed_logprobs_rejects_bad_input(model):
    with pytest.raises(ValueError, match="temperature"):
        policy.packed_logprobs(model, SEQUENCES, temperature=0.0)
    with pytest.raises(ValueError, match="empty"):
        policy.packed_logprobs(model, [[1, 2], []])
    assert "forward" not in vars(model.lm_head)  # the swapped head never outlives a call


def test_world_one_without_torchrun(model_dir, model):
    """Plain `python`: a one-process group, so shard_model and every function run the FSDP2 code path."""
    created = not dist.is_initialized()  # another test file may have made the one-process group already
    try:
        assert policy.init_distributed() == (0, 1, torch.device("cpu"))
        sharded = policy.shard_model(policy.load_model(model_dir), mixed_precision=False,
                                     activation_checkpointing="full")
        lp, _ = policy.packed_logprobs(sharded, SEQUENCES)
        with torch.no_grad():
            ref, _ = policy.packed_logprobs(model, SEQUENCES)
        torch.testing.assert_close(lp.detach(), ref, atol=1e-6, rtol=0)
        mlp, calls = sharded.model.layers[0].mlp, []
        mlp.forward = lambda x, forward=mlp.forward: calls.append(1) or forward(x)  # (recompute skips module hooks)
        lp.sum().backward()
        assert calls == [1], "activation checkpointing must recompute the layer in backward"
        assert policy.clip_grad_norm(sharded, 1.0) > 0
        assert dict(policy.iter_full_weights(sharded)).keys() == dict(model.named_parameters()).keys()
    finally:
        if created:
            dist.destroy_process_group()


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run while it is active, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def test_activation_checkpointing_modes_recompute_what_they_say(model_dir):
    """Every mode gives the same logprobs and gradients; in backward "none" recomputes nothing, "full" reruns each
    layer's matmuls, attention and elementwise ops, "selective" only the elementwise ones."""
    created = not dist.is_initialized()
    try:
        policy.init_distributed()
        results = {}
        for mode in ("none", "full", "selective"):
            sharded = policy.shard_model(policy.load_model(model_dir, dtype=torch.float64),
                                         activation_checkpointing=mode)
            lp, _ = policy.packed_logprobs(sharded, SEQUENCES)
            with OpCounter() as backward_ops:
                (lp * torch.linspace(-1, 1, len(lp), dtype=lp.dtype)).sum().backward()
            results[mode] = lp.detach(), {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
            results[mode + " ops"] = backward_ops.counts
        for mode in ("full", "selective"):
            torch.testing.assert_close(results[mode][0], results["none"][0], atol=1e-12, rtol=0)
            for name, grad in results["none"][1].items():
                torch.testing.assert_close(results[mode][1][name], grad, atol=1e-12, rtol=0, msg=name)
        none, full, selective = results["none ops"], results["full ops"], results["selective ops"]
        layers, projections = 2, 7  # q, k, v, o, gate, up, down per layer
        assert none["silu"] == 0 and selective["silu"] == full["silu"] == layers  # the MLP's activation, redone
        assert selective["rsqrt"] == full["rsqrt"] > none["rsqrt"]  # RMSNorm, redone
        assert selective["mm"] + selective["addmm"] == none["mm"] + none["addmm"]  # no matmul redone
        # full: every projection but the last (down_proj), the recompute stopping once backward has what it needs
        assert full["mm"] + full["addmm"] == none["mm"] + none["addmm"] + layers * (projections - 1)
        with pytest.raises(ValueError, match="none, full or selective"):
            policy.shard_model(policy.load_model(model_dir), activation_checkpointing="every_other")
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.slow  # three compilations
def test_compiled_checkpointing_recomputes_what_eager_does(model_dir):
    """Under compile_layers (the GPU setup) the checkpointed layer is traced whole, and what backward recomputes is
    decided by torch.compile's partitioner from the save policy: the compiled backward graph of a decoder layer holds
    its 2 x 7 gradient matmuls, plus the 6 recomputed projections with "full", and none extra with "selective"."""
    matmuls = {}
    for mode in ("none", "full", "selective"):
        model = policy.load_model(model_dir)
        layer = model.model.layers[0]

        def count_backward_matmuls(graph, example_inputs, mode=mode):
            matmuls[mode] = sum(n.op == "call_function" and "mm" in str(n.target) for n in graph.graph.nodes)
            return graph.forward

        forward = layer.forward if mode == "none" else policy._checkpointed(layer.forward, mode)
        layer.forward = torch.compile(forward, backend=aot_autograd(fw_compiler=lambda graph, _: graph.forward,
                                                                    bw_compiler=count_backward_matmuls))
        model(input_ids=torch.tensor([SEQUENCES[0]]), use_cache=False).logits.sum().backward()
    assert matmuls == {"none": 14, "full": 20, "selective": 14}


@pytest.mark.parametrize("attn", ["flex_attention", "packed_sdpa"])
def test_hf_engine_decodes_a_packed_attention_policy_with_sdpa(model_dir, model, attn):
    """A policy trained with a packed-only attention: its HFEngine replica decodes with sdpa (packed_sdpa has no KV
    cache, flex recompiles per decoding shape) and gives the plain model's greedy tokens."""
    created = not dist.is_initialized()
    try:
        policy.init_distributed()
        sharded = policy.shard_model(policy.load_model(model_dir, attn_implementation=attn))
        engine = engines.HFEngine(sharded, pad_token_id=0)
        engine.load_weights(policy.iter_full_weights(sharded))
        assert engine.model.config._attn_implementation == "sdpa"
        assert sharded.config._attn_implementation == attn
        sampling = engines.Sampling(max_new_tokens=6, temperature=0.0)
        got = engine.generate(SEQUENCES[:3], sampling)
        want = engines.HFEngine(model, pad_token_id=0).generate(SEQUENCES[:3], sampling)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
    finally:
        if created:
            dist.destroy_process_group()


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.slow
@pytest.mark.parametrize("attn,checkpointing,device", [
    ("sdpa", "full", "cpu"), ("packed_sdpa", "full", "cpu"), ("sdpa", "selective", "cpu"),
    pytest.param("flex_attention", "selective", "cuda", marks=ON_GPU),
    pytest.param("flex_attention", "full", "cuda", marks=ON_GPU)])
def test_compiled_layers_match_eager_and_keep_names(model_dir, model, attn, checkpointing, device):
    """compile_layers: same logprobs and gradients as eager, and the parameter names engines and checkpoints use.
    With sdpa and flex_attention the compiled code holds the whole checkpointed layer (selective: its save policy
    too); packed_sdpa is left out of compilation, so the layer runs in pieces."""
    created = not dist.is_initialized()
    try:
        policy.init_distributed()
        eager = policy.shard_model(policy.load_model(model_dir, attn_implementation=attn).to(device),
                                   activation_checkpointing=checkpointing)
        compiled = policy.shard_model(policy.load_model(model_dir, attn_implementation=attn).to(device),
                                      activation_checkpointing=checkpointing, compile_layers=True)
        for sequences in (SEQUENCES, SEQUENCES[1:]):  # a second length: the compiled layers must not be stuck on one
            results = []
            for m in (eager, compiled):
                m.zero_grad()
                lp, _ = policy.packed_logprobs(m, sequences)
                lp.sum().backward()
                results.append((lp.detach(), {n: p.grad.full_tensor() for n, p in m.named_parameters()}))
            torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=0)
            for name, grad in results[0][1].items():
                torch.testing.assert_close(results[1][1][name], grad, atol=1e-5, rtol=1e-4, msg=name)
        assert dict(policy.iter_full_weights(compiled)).keys() == dict(model.named_parameters()).keys()
    finally:
        if created:
            dist.destroy_process_group()


def test_exit_distributed_flushes_and_keeps_the_exit_code():
    """Scripts leave through `exit_distributed` (no interpreter teardown): what they printed must still arrive, with
    the exit code asked for, and nothing after the call may run."""
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        import policy
        policy.init_distributed()
        x = torch.ones(3)
        dist.all_reduce(x)
        print("summed", int(x.sum()), end="")  # no newline: stays in the pipe's buffer until flushed
        policy.exit_distributed(3)
        print("after exit")
    """)
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, env=buffered | {"PYTHONPATH": str(ROOT)}, timeout=300)
    assert run.returncode == 3, run.stderr[-3000:]
    assert run.stdout == "summed 3"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no process group: DCP runs single-process
def test_interrupted_save_is_ignored(model_dir, tmp_path, monkeypatch):
    model = policy.load_model(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert latest_checkpoint(tmp_path) is None
    good = save_checkpoint(tmp_path, 10, model, optimizer, {"step": 10}, hf_source_dir=model_dir)
    assert latest_checkpoint(tmp_path) == good

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr("checkpoint.dcp.save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 20, model, optimizer, {"step": 20}, hf_source_dir=model_dir)
    assert (tmp_path / "checkpoints" / ".tmp_step_00000020").is_dir()  # the debris a crash leaves
    assert latest_checkpoint(tmp_path) == good
    assert load_checkpoint(good, model, optimizer) == {"step": 10}
    monkeypatch.undo()
    again = save_checkpoint(tmp_path, 20, model, optimizer, {"step": 20}, hf_source_dir=model_dir)
    assert latest_checkpoint(tmp_path) == again
    assert not (tmp_path / "checkpoints" / ".tmp_step_00000020").exists()
    with pytest.raises(TypeError):  # not JSON: refused before anything is written
        save_checkpoint(tmp_path, 30, model, optimizer, {"step": object()}, hf_source_dir=model_dir)
    assert latest_checkpoint(tmp_path) == again


@pytest.mark.slow
def test_fsdp2_two_ranks(model_dir, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        ranks.torchrun(2, ROOT / "tests" / "dist_policy.py", model_dir, tmp_path),
        capture_output=True, text=True, env=env, timeout=600)
    passed = {line[3:] for line in result.stdout.splitlines() if line.startswith("ok ")}
    expected = {"iter_full_weights", "same_micro_batch_count", "packed_logprobs_sharded", "hf_engine_sharded", "gradients_sharded", "clip_grad_norm",
                "train_step_changes_params", "checkpoint_roundtrip", "checkpoint_resave_and_prune", "save_hf",
                "mixed_precision"}
    assert result.returncode == 0 and passed == expected, result.stdout[-3000:] + result.stderr[-6000:]
