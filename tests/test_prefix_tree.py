"""Each distinct prefix once in the update: packed rows laid out as a prefix tree (policy._layout), attended by
packed_sdpa and by flex_attention's block mask. A synthetic agent session (a main segment, a branch from an earlier
reply, a retried last turn, a rewrite that keeps the task prompt) beside a second session of the same task: logprobs,
entropies and gradients equal the unshared forward's, and the row holds each distinct prefix once."""

import inspect
import json
import random
import textwrap

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import policy
import tiny

CORPUS = [inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap, inspect)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS, seed=3)


def session_group(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(sequences, score_from) of two sessions of one task, SWE-shaped in miniature: turns of a sampled reply and a
    longer tool output. Session 1: its main segment, a branch continuing its 2nd reply, its last turn retried, a
    rewrite of its history (task prompt kept, the rest new). Session 2: its main segment."""
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(3, 500) for _ in range(n)]

    task = ids(24)
    turns = [(ids(6), ids(14)) for _ in range(4)]  # (reply, tool output)
    history = task + [t for reply, tool in turns[:3] for t in reply + tool]
    main = history + turns[3][0] + turns[3][1]
    after_second = task + [t for reply, tool in turns[:2] for t in reply + tool][:-14]  # up to the 2nd reply
    branch = after_second + ids(14) + ids(6) + ids(14)
    retried = history + ids(6)
    rewrite = task + ids(10) + ids(6)
    other = task + ids(6) + ids(14) + ids(6)
    sequences = [main, branch, retried, rewrite, other]
    return sequences, [len(task), len(after_second), len(history), len(task) + 10, len(task)]


def distinct_prefixes(sequences: list[list[int]]) -> int:
    return len({tuple(s[:k]) for s in sequences for k in range(1, len(s) + 1)})


def test_a_session_runs_each_distinct_prefix_once_with_the_unshared_numbers(model_dir, monkeypatch):
    sequences, score_from = session_group()
    rows = []
    embed = torch.nn.Embedding.forward
    monkeypatch.setattr(torch.nn.Embedding, "forward", lambda self, ids: rows.append(ids.shape[-1]) or embed(self, ids))
    results = {}
    for share in (False, True):
        model = policy.load_model(model_dir, attn_implementation="packed_sdpa")
        lp, ent = policy.packed_logprobs(model, sequences, with_entropy=True, score_from=score_from,
                                         share_prefixes=share)
        (lp.sum() + 0.5 * ent.sum()).backward()
        results[share] = lp.detach(), ent.detach(), [p.grad for p in model.parameters()]
    assert rows == [sum(map(len, sequences)), distinct_prefixes(sequences)]
    # Before the tree only equal prompts ran once (the vision rule, given equal image keys): the two main segments'.
    today = policy._layout(sequences, score_from, True, prefix_keys=[()] * len(sequences))[0]
    assert len(today) == sum(map(len, sequences)) - score_from[0]
    # The tree also runs once the branch's and the retry's prompts (the main segment's) and the rewrite's task.
    assert rows[1] == len(today) - score_from[1] - score_from[2] - score_from[0]
    (want_lp, want_ent, want_grads), (lp, ent, grads) = results[False], results[True]
    torch.testing.assert_close(lp, want_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=0)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_values_of_a_session_are_the_unshared_ones(model_dir):
    sequences, score_from = session_group(1)
    critic = policy.load_value_model(model_dir, attn_implementation="packed_sdpa")
    with torch.no_grad():
        critic.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
        shared, whole = (policy.packed_values(critic, sequences, score_from=score_from, share_prefixes=share)
                         for share in (True, False))
    assert whole.abs().sum() > 0
    torch.testing.assert_close(shared, whole, atol=1e-5, rtol=1e-5)


def ancestors_mask(positions: list[int]) -> torch.Tensor:
    """What a token of a pre-order prefix-tree row sees, by walking the path: the tokens at positions 0..its own of
    the path it extends."""
    dense = torch.zeros(len(positions), len(positions), dtype=torch.bool)
    path = []
    for row, position in enumerate(positions):
        path = path[:position] + [row]
        dense[row, path] = True
    return dense


def test_block_mask_of_a_random_forest_is_the_ancestor_mask():
    rng = random.Random(0)
    sequences = []
    for _ in range(12):  # each sequence a random continuation of a random earlier one's prefix, or a new one
        base = rng.choice(sequences)[: rng.randrange(1, 20)] if sequences and rng.random() < 0.8 else []
        sequences.append(base + [rng.randrange(3, 9) for _ in range(rng.randrange(1, 12))])
    ids, positions, *_ = policy._layout(sequences, [1] * len(sequences), True)
    assert len(ids) == distinct_prefixes(sequences)
    mask = policy.branch_block_mask(torch.tensor(positions))
    dense = create_mask(mask.mask_mod, None, None, len(ids), len(ids), device="cpu")[0, 0]
    assert torch.equal(dense, ancestors_mask(positions))


def test_pack_counts_each_distinct_prefix_once(model_dir):
    """A micro-batch holds the session group when its budget is the tree's size, and not one token less; under sdpa
    (no sharing) every sequence counts whole."""
    sequences, score_from = session_group()
    shares, whole = (policy.load_model(model_dir, attn_implementation=a) for a in ("packed_sdpa", "sdpa"))
    index, tree = list(range(len(sequences))), distinct_prefixes(sequences)
    assert policy.pack(index, sequences, tree, score_from, shares) == [index]
    assert len(policy.pack(index, sequences, tree - 1, score_from, shares)) == 2
    assert len(policy.pack(index, sequences, tree, score_from, whole)) > 2


@pytest.mark.slow  # flex_attention compiles (about 15 s on the 2-core CPU)
def test_flex_attention_runs_the_tree_with_the_unshared_numbers(model_dir):
    sequences, score_from = session_group(2)
    model = policy.load_model(model_dir, attn_implementation="flex_attention")
    with torch.no_grad():
        got, got_ent = policy.packed_logprobs(model, sequences, with_entropy=True, score_from=score_from,
                                              share_prefixes=True)
        want, want_ent = policy.packed_logprobs(policy.load_model(model_dir, attn_implementation="packed_sdpa"),
                                                sequences, with_entropy=True, score_from=score_from)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(got_ent, want_ent, atol=2e-5, rtol=0)
