"""engines.HFEngine: its decoding loop samples from exactly the distribution the trainer scores (transformers' warpers
on the model's logits), whatever the model's saved generation_config says; greedy decoding is generate()'s."""

import inspect
import json

import pytest
import torch

from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import engines
import policy
import tiny

CORPUS = [inspect.getsource(m) for m in (json.decoder, json.encoder)]
PROMPTS = [[1, 9, 40, 41, 42, 7], [1, 9, 50], [1, 60, 61, 62, 63, 64, 65, 66, 67], [1, 70, 71]]
STOP_IDS = [2, 0, *range(400, 416)]  # more than EOS, so that some rows stop early and others run to the limit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS, seed=5)


@pytest.fixture()
def model(model_dir):
    return policy.load_model(model_dir).eval()


def generate_reference(model, prompts, sampling, pad_token_id=0):
    """transformers' generate() on the same left-padded batch: completions cut at the first stop id, logprobs of the
    processed scores (what generate sampled from)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts], device=model.device)
    attention_mask = (input_ids != pad_token_id).long()
    sample = sampling.temperature > 0
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=sampling.max_new_tokens,
                         do_sample=sample, temperature=sampling.temperature if sample else None,
                         top_k=sampling.top_k if sample else None, top_p=sampling.top_p if sample else None,
                         eos_token_id=sampling.stop_token_ids, pad_token_id=pad_token_id,
                         return_dict_in_generate=True, output_scores=True)
    new = out.sequences[:, width:].cpu()
    logprobs = torch.stack(out.scores, 1).log_softmax(-1).cpu().gather(-1, new[..., None]).squeeze(-1)
    return [engines.truncate_at_stop(new[i].tolist(), logprobs[i].tolist(), set(sampling.stop_token_ids))
            for i in range(len(prompts))]


def warped_logprobs(model, prompts, completions, sampling):
    """log p(token) of each completion token under transformers' warpers applied to logits from one plain forward of
    the whole left-padded prompt + completion (no KV cache): what the engine claims to have sampled from."""
    seqs = [p + c.token_ids for p, c in zip(prompts, completions)]
    width = max(map(len, seqs))
    ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention_mask,
                       position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        start = width - len(seqs[i]) + len(p)  # logits at j predict token j + 1
        scores = logits[i, start - 1 : width - 1]
        for warper in [TemperatureLogitsWarper(sampling.temperature)] + (
                [TopKLogitsWarper(sampling.top_k)] if sampling.top_k else []) + (
                [TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1 else []):
            scores = warper(None, scores)
        out.append(scores.log_softmax(-1).gather(1, torch.tensor(c.token_ids, device=model.device)[:, None])[:, 0])
    return out


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu,
                                   pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_greedy_hf_engine_equals_generate(model, device):
    """Repeated prompts too (the engine prefills each distinct prompt once and copies its cache rows)."""
    model.to(device)
    sampling = engines.Sampling(max_new_tokens=24, temperature=0.0, stop_token_ids=STOP_IDS)
    prompts = PROMPTS + PROMPTS[2:0:-1] + PROMPTS[1:2]
    got = engines.HFEngine(model, pad_token_id=0).generate(prompts, sampling)
    want = generate_reference(model, prompts, sampling)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-6, rtol=0)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=20),
                                      dict(temperature=1.3, top_p=0.8)])
def test_hf_engine_logprobs_are_the_warped_distribution(model, settings, device):
    """Each sampled token's logprob is its log-probability under the warped scores of a plain forward (no KV cache,
    no decode_step), and no token outside top-k / top-p is ever drawn (its logprob would be -inf)."""
    model.to(device)
    sampling = engines.Sampling(max_new_tokens=24, stop_token_ids=STOP_IDS, **settings)
    prompts = [p for p in PROMPTS for _ in range(3)]
    torch.manual_seed(11)
    got = engines.HFEngine(model, pad_token_id=0).generate(prompts, sampling)
    for completion, want in zip(got, warped_logprobs(model, prompts, got, sampling)):
        assert torch.isfinite(want).all()
        torch.testing.assert_close(torch.tensor(completion.logprobs), want.cpu(), atol=1e-5, rtol=0)
    assert {c.finish_reason for c in got} == {"stop", "length"}  # rows differ in length: the early stop is tested
    torch.manual_seed(11)
    assert [c.token_ids for c in engines.HFEngine(model, pad_token_id=0).generate(prompts, sampling)] == \
        [c.token_ids for c in got]  # same seed, same draws


def test_sample_from_draws_the_given_distribution():
    """Frequencies over 400k draws within 5 standard errors of each probability; zero-probability tokens (what top-k
    and top-p leave) are never drawn, including the last one, which a CDF rounding short of 1 would pick."""
    probs = torch.tensor([0.0, 0.5, 0.25, 0.0, 0.125, 0.0625, 0.0625, 0.0])
    draws = 400_000
    torch.manual_seed(0)
    counts = torch.bincount(engines.sample_from(probs.expand(draws, -1)), minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    standard_error = (probs * (1 - probs) / draws).double().sqrt()
    assert ((counts / draws - probs).abs() <= 5 * standard_error).all(), counts / draws
    peaked = torch.zeros(3, 152064).index_fill_(1, torch.tensor([7]), 1.0)  # a one-hot row at vocab 152k
    assert engines.sample_from(peaked).tolist() == [7, 7, 7]


def test_seeded_rows_do_not_depend_on_their_batch(model):
    """With a seed per prompt, a row's tokens are the same alone, in another batch, in another order and after other
    draws from torch's stream; its logprobs agree to 1e-6 (fp32 padding and batch-size rounding: 4.8e-7 measured).
    Other seeds draw other tokens."""
    sampling = engines.Sampling(max_new_tokens=16, temperature=1.0, stop_token_ids=STOP_IDS)
    seeds = [engines.derive_seed(3, "row", i) for i in range(len(PROMPTS))]
    engine = engines.HFEngine(model, pad_token_id=0)
    batched = engine.generate(PROMPTS, sampling, seeds=seeds)
    torch.rand(5)  # the global stream moves: seeded rows do not see it
    alone = [engine.generate([p], sampling, seeds=[s])[0] for p, s in zip(PROMPTS, seeds)]
    backwards = engine.generate(PROMPTS[::-1], sampling, seeds=seeds[::-1])[::-1]
    for got in (alone, backwards):
        assert [c.token_ids for c in got] == [c.token_ids for c in batched]
        for g, b in zip(got, batched):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0)
    other = engine.generate(PROMPTS, sampling, seeds=[s + 1 for s in seeds])
    assert [c.token_ids for c in other] != [c.token_ids for c in batched]
    assert engines.derive_seed(3, "row", 0) == seeds[0] != engines.derive_seed(3, "row", 1) < 2**63
    with pytest.raises(ValueError, match="one seed per prompt"):
        engine.generate(PROMPTS, sampling, seeds=seeds[:1])


@pytest.mark.parametrize("kind", ["tiny", "qwen3"])
def test_continuous_batching_draws_what_generate_draws(model, kind):
    """HFEngine.submit/step: requests joining the running batch at different steps, with their own budgets, stop tokens
    and stop strings, leaving it as they end, get the tokens generate() draws for each alone from the same seed, the
    same finish reasons, and logprobs within 1e-6 (rows side by side in one buffer at different lengths: fp32 batch
    rounding). Qwen3 (per-head q/k norms, head_dim != hidden/heads) too."""
    model = model if kind == "tiny" else tiny_decoder(kind)
    engine = engines.HFEngine(model, pad_token_id=0, tokenizer=policy.load_tokenizer(str(model.name_or_path))
                              if kind == "tiny" else None)
    assert engine.continuous
    prompts = PROMPTS + [PROMPTS[1], PROMPTS[2][:4], list(range(100, 160))]  # a prompt twice: prefilled once, drawn
    # apart by its seed; a long one, for which the buffer grows
    budgets = [16, 5, 12, 1, 9, 16, 6]
    stops = [[]] * 7 if kind == "qwen3" else [[], ["e"], [], [], [], ["de"], []]
    requests = [engines.Sampling(max_new_tokens=b, temperature=1.0, top_k=50, stop_token_ids=STOP_IDS, stop=s)
                for b, s in zip(budgets, stops)]
    seeds = [engines.derive_seed(9, i) for i in range(len(prompts))]
    want = [engine.generate([p], r, seeds=[s])[0] for p, r, s in zip(prompts, requests, seeds)]
    joins = {0: [0, 1], 1: [2], 3: [3, 4, 6], 6: [5]}  # step -> requests submitted before it
    got, step, in_batch = {}, 0, []
    while len(got) < len(prompts):
        for i in joins.get(step, []):
            engine.submit(i, prompts[i], requests[i], seeds[i])
        got |= dict(engine.step())
        in_batch.append(len(engine.running.requests) if engine.running else 0)
        step += 1
    assert max(in_batch) >= 3 and engine.running is None and not engine.queued
    assert [got[i].token_ids for i in range(len(prompts))] == [c.token_ids for c in want]
    assert [got[i].finish_reason for i in range(len(prompts))] == [c.finish_reason for c in want]
    assert {c.finish_reason for c in want} == {"stop", "length"} and len(got[3].token_ids) == 1
    for i, c in enumerate(want):
        torch.testing.assert_close(torch.tensor(got[i].logprobs), torch.tensor(c.logprobs), atol=1e-6, rtol=0)
    if kind == "tiny":  # a stop string ended a request (its completing token kept)
        assert any(s and got[i].finish_reason == "stop" and got[i].token_ids[-1] not in STOP_IDS
                   for i, s in enumerate(stops))
    engine.submit("x", PROMPTS[0], requests[0])
    with pytest.raises(ValueError, match="differ from the running"):
        engine.submit("y", PROMPTS[0], engines.Sampling(temperature=0.5))
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.load_weights([])
    engine.abort()
    assert engine.step() == [] and engine.running is None
    engine.load_weights([])  # nothing in flight: a plain model's engine has nothing to load


def tiny_decoder(kind: str):
    """A randomly initialised 2-layer model of each Llama-layout family decode_step serves."""
    common = dict(vocab_size=420, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(1)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common)).eval()  # own q/k norms, head_dim != hidden/heads
    return LlamaForCausalLM(LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                        **common)).eval()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_lean_decoding_equals_the_models_forward(kind):
    """decode_step (the engine's loop for Llama-layout models) against the model's own forward: the same greedy
    tokens and logprobs as generate(), and with sampling the same draws from the same seed as the engine decoding
    through the model's forward."""
    model = tiny_decoder(kind)
    assert engines.lean_decoding_supported(model)
    greedy = engines.Sampling(max_new_tokens=20, temperature=0.0)
    got = engines.HFEngine(model, pad_token_id=0).generate(PROMPTS, greedy)
    want = generate_reference(model, PROMPTS, greedy)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
    sampling = engines.Sampling(max_new_tokens=20, temperature=1.0)
    runs = []
    for lean in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(engines, "lean_decoding_supported", lambda m: lean)
            torch.manual_seed(4)
            runs.append(engines.HFEngine(model, pad_token_id=0).generate(PROMPTS, sampling))
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]
    for a, b in zip(*runs):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_models_lean_decoding_cannot_serve_decode_with_their_forward(model_dir):
    """A sliding window (or a family decode_step does not know) keeps the model's own forward, which applies it."""
    config = policy.load_model(model_dir).config
    config.update(dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"]))
    windowed = Qwen2ForCausalLM(config).eval()
    assert not engines.lean_decoding_supported(windowed)
    assert not engines.lean_decoding_supported(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)))
    dynamic = LlamaForCausalLM(LlamaConfig(vocab_size=420, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                           num_attention_heads=4, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert not engines.lean_decoding_supported(dynamic)  # its frequencies change as the generation grows
    hooked = tiny_decoder("qwen2")
    assert engines.lean_decoding_supported(hooked)
    hooked.model.layers[1].mlp.up_proj.register_forward_hook(lambda module, args, out: out * 2)
    assert not engines.lean_decoding_supported(hooked)  # decode_step would skip the hook
    greedy = engines.Sampling(max_new_tokens=12, temperature=0.0)
    got = engines.HFEngine(windowed, pad_token_id=0).generate(PROMPTS, greedy)
    assert [c.token_ids for c in got] == [c.token_ids for c in generate_reference(windowed, PROMPTS, greedy)]


def test_hf_engine_ignores_the_models_generation_config(model):
    """A checkpoint's generation_config (Qwen2.5 ships repetition_penalty 1.1, top_k 20) must not reach the engine:
    the trainer scores completions under softmax(logits / temperature) and nothing else."""
    sampling = engines.Sampling(max_new_tokens=16, temperature=1.0)
    torch.manual_seed(3)
    plain = engines.HFEngine(model, pad_token_id=0).generate(PROMPTS, sampling)
    model.generation_config.update(repetition_penalty=1.5, top_k=3, top_p=0.5, temperature=0.3, no_repeat_ngram_size=2)
    torch.manual_seed(3)
    got = engines.HFEngine(model, pad_token_id=0).generate(PROMPTS, sampling)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    trained, _ = policy.packed_logprobs(model, [p + c.token_ids for p, c in zip(PROMPTS, got)])
    start = 0
    for prompt, completion in zip(PROMPTS, got):
        end = start + len(prompt) + len(completion.token_ids)
        torch.testing.assert_close(trained[start + len(prompt) : end].detach(), torch.tensor(completion.logprobs),
                                   atol=1e-5, rtol=0)
        start = end
