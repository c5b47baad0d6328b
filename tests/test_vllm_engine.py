"""VLLMEngine's own logic on CPU, without vllm: weight bucketing, output conversion, and the wake/load/generate/sleep
sequence driven against a small in-memory stand-in for `vllm.LLM` (the real API is checked by `make test-vllm`)."""
import hashlib
import io
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import AutoConfig

import engines
import tiny
import vision


def named(sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes)]


def test_bucket_weights_hand_computed():
    # float32: 10 elements = 40 bytes, 50 = 200 bytes; cap 100 bytes
    buckets = list(engines.bucket_weights(named([10, 10, 50, 10, 10, 10]), cap_bytes=100))
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"], ["w5"]]
    # cast to bf16 halves every tensor: 20 + 20 + 100 > 100, so the big one still travels alone
    buckets = list(engines.bucket_weights(named([10, 10, 50, 10, 10, 10]), cap_bytes=100, dtype=torch.bfloat16))
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4", "w5"]]
    assert all(t.dtype == torch.bfloat16 for b in buckets for _, t in b)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 64), max_size=30), cap_elems=st.integers(1, 100))
def test_bucket_weights_properties(sizes, cap_elems):
    cap = cap_elems * 4
    buckets = list(engines.bucket_weights(named(sizes), cap_bytes=cap))
    flat = [(name, t) for b in buckets for name, t in b]
    assert [name for name, _ in flat] == [f"w{i}" for i in range(len(sizes))]  # order kept, nothing dropped
    assert all(torch.equal(t, torch.full((n,), float(i))) for (_, t), (i, n) in zip(flat, enumerate(sizes)))
    for i, b in enumerate(buckets):
        size = sum(t.nbytes for _, t in b)
        assert b and (size <= cap or len(b) == 1)  # over the cap only as a single tensor
        if i + 1 < len(buckets):  # greedy: the next tensor did not fit
            assert size + buckets[i + 1][0][1].nbytes > cap


@dataclass
class Logprob:
    logprob: float


@dataclass
class FlatLogprobs:  # the shape of vllm.logprobs.FlatLogprobs
    start_indices: list
    end_indices: list
    token_ids: list
    logprobs: list

    def __len__(self):
        return len(self.start_indices)


def request_output(token_ids, logprobs, finish_reason="stop", request_id="0"):
    completion = types.SimpleNamespace(token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason)
    return types.SimpleNamespace(request_id=request_id, outputs=[completion])


def test_completion_from_vllm_dict_and_flat_logprobs():
    per_position = [{5: Logprob(-0.5)}, {9: Logprob(-0.1), 7: Logprob(-2.0)}, {2: Logprob(-0.25)}]
    c = engines.completion_from_vllm(request_output([5, 7, 2], per_position))
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([5, 7, 2], [-0.5, -2.0, -0.25], "stop")
    # flat: position 1 holds the top-1 token (9) before the sampled one (7)
    flat = FlatLogprobs([0, 1, 3], [1, 3, 4], [5, 9, 7, 2], [-0.5, -0.1, -2.0, -0.25])
    c = engines.completion_from_vllm(request_output((5, 7, 2), flat, "length"))
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([5, 7, 2], [-0.5, -2.0, -0.25], "length")


def test_completion_from_vllm_refuses_what_it_cannot_trust():
    with pytest.raises(RuntimeError, match="request 3: 2 tokens but 1 logprob"):
        engines.completion_from_vllm(request_output([5, 7], [{5: Logprob(-0.5)}], request_id="3"))
    with pytest.raises(RuntimeError, match="no logprob"):
        engines.completion_from_vllm(request_output([5], None))
    with pytest.raises(RuntimeError, match="'abort'"):
        engines.completion_from_vllm(request_output([5], [{5: Logprob(-0.5)}], "abort"))


def test_kwargs_builders():
    kw = engines.vllm_llm_kwargs("m", rank=5, seed=10, tensor_parallel_size=2, gpu_memory_utilization=0.4,
                                 max_model_len=2048, max_num_seqs=64, enforce_eager=True, dtype="bfloat16")
    assert kw["seed"] == 12  # rank 5 is in the third TP pair
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["enable_sleep_mode"] is True
    assert kw["logprobs_mode"] == "processed_logprobs"
    sp = engines.vllm_sampling_kwargs(engines.Sampling(max_new_tokens=7, temperature=0.6, top_p=0.9, top_k=20,
                                                       stop_token_ids=[2, 0]))
    assert sp == dict(n=1, max_tokens=7, temperature=0.6, top_p=0.9, top_k=20, stop_token_ids=[2, 0], stop=[],
                      include_stop_str_in_output=True, skip_special_tokens=False, logprobs=0, flat_logprobs=True,
                      detokenize=False, seed=None)  # no stop strings: vLLM need not detokenize
    assert engines.vllm_sampling_kwargs(engines.Sampling(), seed=11)["seed"] == 11  # the request's own generator
    with_stop = engines.vllm_sampling_kwargs(engines.Sampling(max_new_tokens=7, stop=["</code>"]))
    assert with_stop["stop"] == ["</code>"] and with_stop["detokenize"] is True
    assert engines.vllm_prompt((1, 2)) == {"prompt_token_ids": [1, 2]}
    assert "limit_mm_per_prompt" not in kw
    kw = engines.vllm_llm_kwargs("m", rank=0, seed=0, tensor_parallel_size=1, gpu_memory_utilization=0.4,
                                 max_model_len=2048, max_num_seqs=64, enforce_eager=True, dtype="bfloat16",
                                 max_images_per_prompt=6)
    assert kw["limit_mm_per_prompt"] == {"image": 6, "video": 0}
    assert engines.vllm_sampling_kwargs(engines.Sampling(), [5, 6])["logit_bias"] == {5: -100.0, 6: -100.0}


def png(width, height, colour) -> bytes:
    out = io.BytesIO()
    Image.new("RGBA", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def test_vllm_prompt_with_images():
    """One unexpanded placeholder per image stays as it is; images go as RGB PIL images (a side under 28 px scaled
    up) with content hashes as uuids, equal for equal images."""
    red, blue = png(40, 10, (255, 0, 0, 255)), png(30, 30, (0, 0, 255, 128))
    prompt = engines.vllm_prompt([1, 5, 2, 1, 5, 2, 1, 5, 2], [red, blue, red])
    assert prompt["prompt_token_ids"] == [1, 5, 2, 1, 5, 2, 1, 5, 2]
    items = prompt["multi_modal_data"]["image"]
    assert [(i.mode, i.size) for i in items] == [("RGB", (112, 28)), ("RGB", (30, 30)), ("RGB", (112, 28))]
    uuids = prompt["multi_modal_uuids"]["image"]
    assert uuids[0] == uuids[2] == hashlib.sha256(red).hexdigest() != uuids[1]


class TinyVLLMModel(torch.nn.Module):
    """Loads weights by name like a vLLM model (and, like vLLM's loader, refuses names it does not have)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.to(torch.bfloat16)

    def load_weights(self, weights):
        params, loaded = dict(self.named_parameters()), set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


class FakeLLM:
    """Records the calls VLLMEngine makes, in order; generates by echoing the prompt's last token."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.model = kwargs, [], TinyVLLMModel()
        self.prompts, self.added_tokens = [], 0  # what generate got; what it says the images added to each prompt
        if Path(kwargs["model"]).is_dir():  # a real folder: its config, as vLLM reads it
            hf_config = AutoConfig.from_pretrained(kwargs["model"])
            text_config = hf_config.get_text_config()
        else:
            hf_config = text_config = types.SimpleNamespace(tie_word_embeddings=True)
        self.llm_engine = types.SimpleNamespace(
            model_config=types.SimpleNamespace(hf_config=hf_config, hf_text_config=text_config),
            reset_encoder_cache=lambda: self.calls.append(("reset_encoder",)))

    def apply_model(self, fn):
        self.calls.append(("apply_model",))
        return [fn(self.model)]

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", len(prompts)))
        self.prompts, self.params = prompts, params
        outputs = [request_output([p["prompt_token_ids"][-1]] * 2, [{p["prompt_token_ids"][-1]: Logprob(-1.0)}] * 2,
                                  request_id=str(i)) for i, p in enumerate(prompts)]
        for p, o in zip(prompts, outputs):
            o.prompt_token_ids = p["prompt_token_ids"] + [0] * (self.added_tokens if "multi_modal_data" in p else 0)
        return outputs


@pytest.fixture
def engine(monkeypatch):
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=dict))
    return engines.VLLMEngine("some/model", seed=3, sync_bucket_bytes=40)


def test_vllm_engine_step_sequence(engine):
    llm = engine.llm
    assert llm.kwargs["model"] == "some/model" and llm.kwargs["seed"] == 3
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    engine.sleep()
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.load_weights([])
    engine.wake_up()
    with pytest.raises(RuntimeError, match="level-2 sleep discards the weights"):
        engine.generate([[1]], engines.Sampling())
    new = {"embed.weight": torch.randn(8, 4), "proj.weight": torch.randn(4, 4), "proj.bias": torch.randn(4),
           "lm_head.weight": torch.randn(8, 4)}  # tied to embed: never sent
    llm.calls.clear()
    engine.load_weights(iter(new.items()))
    # embed is 64 bytes in bf16 (over the 40-byte cap: alone), proj weight+bias 32 + 8 bytes (together)
    assert llm.calls == [("apply_model",), ("apply_model",), ("wake_up", ["kv_cache"]), ("reset_prefix_cache",),
                         ("reset_encoder",)]
    for name, tensor in llm.model.named_parameters():
        assert torch.equal(tensor, new[name].to(torch.bfloat16)), name
    assert engine.last_metrics["vllm/sync_bytes"] == 64 + 32 + 8 and engine.last_metrics["vllm/sync_buckets"] == 2
    out = engine.generate([[4, 5], [6]], engines.Sampling(max_new_tokens=2))
    assert [(c.token_ids, c.logprobs) for c in out] == [([5, 5], [-1.0, -1.0]), ([6, 6], [-1.0, -1.0])]
    assert llm.params["seed"] is None  # one SamplingParams for the call: the engine's own stream
    engine.generate([[4, 5], [6]], engines.Sampling(max_new_tokens=2), seeds=[11, 12])
    assert [params["seed"] for params in llm.params] == [11, 12]  # one SamplingParams per request, with its seed
    with pytest.raises(ValueError, match="one seed per prompt"):
        engine.generate([[4, 5], [6]], engines.Sampling(max_new_tokens=2), seeds=[11])
    assert engine.last_metrics["vllm/generate_tokens_per_s"] > 0
    llm.calls.clear()
    engine.sleep()
    engine.sleep()  # already asleep: nothing more to do
    engine.wake_up()
    assert llm.calls == [("sleep", 2), ("wake_up", ["weights"])]


def test_vllm_engine_refuses_a_partial_sync(engine):
    engine.sleep()
    engine.wake_up()
    with pytest.raises(RuntimeError, match=r"1 vLLM parameters got no weights, e.g. \['proj.bias'\]"):
        engine.load_weights([("embed.weight", torch.zeros(8, 4)), ("proj.weight", torch.zeros(4, 4))])


@pytest.fixture
def vl_engine(monkeypatch, tmp_path):
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=dict))
    folder = tiny.make_tiny_vlm(tmp_path / "vl", ["<answer>red</answer> The answer is 3."] * 50)
    return engines.VLLMEngine(str(folder), max_images_per_prompt=5)


def test_vllm_engine_with_a_vision_model(vl_engine):
    """A Qwen2.5-VL folder: image budget, tied flag from the top-level config, placeholders banned in sampling,
    PIL images with uuids, and the engine's expanded prompt length checked against kiln's image processor."""
    llm, config = vl_engine.llm, vl_engine.llm.llm_engine.model_config.hf_config
    assert llm.kwargs["limit_mm_per_prompt"] == {"image": 5, "video": 0}
    assert vl_engine.tied_lm_head and getattr(config.get_text_config(), "tie_word_embeddings", None) is not True
    image = png(300, 201, (0, 128, 0, 255))
    grid = vision.image_processor(llm.kwargs["model"])(images=[Image.open(io.BytesIO(image))])["image_grid_thw"]
    llm.added_tokens = int(grid.prod()) // 4 - 1  # what vLLM's expansion adds for this image
    question = [1, config.vision_start_token_id, config.image_token_id, config.vision_end_token_id, 7]
    out = vl_engine.generate([question, [1, 7]], engines.Sampling(max_new_tokens=2), images=[[image], None])
    assert [c.token_ids for c in out] == [[7, 7], [7, 7]]
    assert llm.params["logit_bias"] == {config.image_token_id: -100.0, config.video_token_id: -100.0}
    assert llm.prompts[0]["multi_modal_uuids"] == {"image": [hashlib.sha256(image).hexdigest()]}
    assert "multi_modal_data" not in llm.prompts[1]
    llm.added_tokens -= 1
    with pytest.raises(RuntimeError, match="expanded a prompt with 1 images to"):
        vl_engine.generate([question], engines.Sampling(), images=[[image]])
    with pytest.raises(ValueError, match="2 images and 1 image placeholders"):
        vl_engine.generate([question], engines.Sampling(), images=[[image, image]])
