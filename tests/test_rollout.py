"""rollout.HFEngine: its decoding loop draws what `generate()` draws, and samples from exactly the distribution the
trainer scores, whatever the model's saved generation_config says."""

import inspect
import json

import pytest
import torch

import policy
import rollout

CORPUS = [inspect.getsource(m) for m in (json.decoder, json.encoder)]
PROMPTS = [[1, 9, 40, 41, 42, 7], [1, 9, 50], [1, 60, 61, 62, 63, 64, 65, 66, 67], [1, 70, 71]]
STOP_IDS = [2, 0, *range(400, 416)]  # more than EOS, so that some rows stop early and others run to the limit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return policy.make_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS, seed=5)


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
    return [rollout.truncate_at_stop(new[i].tolist(), logprobs[i].tolist(), set(sampling.stop_token_ids))
            for i in range(len(prompts))]


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu,
                                   pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=20),
                                      dict(temperature=1.3, top_p=0.8), dict(temperature=0.0)])
def test_hf_engine_draws_what_generate_draws(model, settings, device):
    model.to(device)
    sampling = rollout.Sampling(max_new_tokens=24, stop_token_ids=STOP_IDS, **settings)
    prompts = [p for p in PROMPTS for _ in range(3)]
    torch.manual_seed(11)
    got = rollout.HFEngine(model, pad_token_id=0).generate(prompts, sampling)
    torch.manual_seed(11)
    want = generate_reference(model, prompts, sampling)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-6, rtol=0)
    if settings["temperature"] > 0:  # the rows must differ in length, or the early stop is untested
        assert {c.finish_reason for c in got} == {"stop", "length"}


def test_hf_engine_ignores_the_models_generation_config(model):
    """A checkpoint's generation_config (Qwen2.5 ships repetition_penalty 1.1, top_k 20) must not reach the engine:
    the trainer scores completions under softmax(logits / temperature) and nothing else."""
    sampling = rollout.Sampling(max_new_tokens=16, temperature=1.0)
    torch.manual_seed(3)
    plain = rollout.HFEngine(model, pad_token_id=0).generate(PROMPTS, sampling)
    model.generation_config.update(repetition_penalty=1.5, top_k=3, top_p=0.5, temperature=0.3, no_repeat_ngram_size=2)
    torch.manual_seed(3)
    got = rollout.HFEngine(model, pad_token_id=0).generate(PROMPTS, sampling)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    trained, _ = policy.packed_logprobs(model, [p + c.token_ids for p, c in zip(PROMPTS, got)])
    start = 0
    for prompt, completion in zip(PROMPTS, got):
        end = start + len(prompt) + len(completion.token_ids)
        torch.testing.assert_close(trained[start + len(prompt) : end].detach(), torch.tensor(completion.logprobs),
                                   atol=1e-5, rtol=0)
        start = end
