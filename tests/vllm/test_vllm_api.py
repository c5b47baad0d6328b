"""Every vLLM call kiln makes, checked against the real vllm==0.32.0 package (`make test-vllm`, CPU only).

No vLLM engine can start without a GPU, so VLLMEngine is driven against `RecordingLLM`: each call it makes is bound
to the real `vllm.LLM` method's signature, its weights go through the real vLLM Qwen2 model's `load_weights` (built
on CPU; only the attention kernel, which holds no weights, is a stand-in), and its outputs are vLLM's own classes.
The same for Qwen2.5-VL: kiln's weight names through vLLM's Qwen2_5_VLForConditionalGeneration, and vLLM's count of
an image's tokens against kiln's.
"""
import dataclasses
import hashlib
import io
import inspect
import os
import socket
import sys
import types
import typing

import pytest
import torch
import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as qwen2_vl_pil
from PIL import Image

# vLLM's Qwen2-VL module imports smart_resize from transformers' torchvision image processor, and the only torchvision
# wheel is a CUDA build that cannot import on a CPU torch: the PIL processor's identical function stands in.
sys.modules.setdefault("transformers.models.qwen2_vl.image_processing_qwen2_vl",
                       types.SimpleNamespace(smart_resize=qwen2_vl_pil.smart_resize))

import vllm  # noqa: E402 (after the stand-in above)
import vllm.model_executor.models.registry as vllm_registry  # noqa: E402
from vllm import LLM, SamplingParams
from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                             init_distributed_environment, initialize_model_parallel)
from vllm.engine.arg_utils import EngineArgs
from vllm.inputs import TokensPrompt
from vllm.config.lora import LoRAConfig
from vllm.logprobs import FlatLogprobs, append_logprobs_for_next_position, create_sample_logprobs
import vllm.lora.lora_model as vllm_lora_model  # noqa: E402
from vllm.lora.lora_model import LoRAModel
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingType
from vllm.v1.engine.detokenizer import IncrementalDetokenizer, uses_fast_detokenizer
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.executor.abstract import SLEEP_TAGS

import chat
import engines
import policy
import tiny
import vision

pytestmark = pytest.mark.vllm


def llm_kwargs(model_dir, **overrides):
    settings = dict(rank=0, seed=0, tensor_parallel_size=1, gpu_memory_utilization=0.5, max_model_len=256,
                    max_num_seqs=8, enforce_eager=True, dtype="float32") | overrides
    return engines.vllm_llm_kwargs(str(model_dir), **settings)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """kiln's own tiny model (Qwen2-shaped, tied embeddings), so policy's parameter names meet vLLM's loader."""
    corpus = ["def add(a, b):\n    return a + b\n", "for i in range(3):\n    print(i)\n"] * 20
    return tiny.make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), corpus)


class StandInAttention(torch.nn.Module):
    """The attention kernel: vLLM cannot pick a backend without a GPU. It holds no weights (unquantized)."""

    def __init__(self, *args, **kwargs):
        super().__init__()


@pytest.fixture(scope="module")
def vllm_parallel_state():
    """vLLM's (one-process) model-parallel groups, which building its models needs: once for the module."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


@pytest.fixture(scope="module")
def vllm_qwen2(model_dir, vllm_parallel_state):
    """(vLLM's Qwen2ForCausalLM on CPU, its ModelConfig, the same model loaded by kiln's policy as weight source)."""
    model_config = ModelConfig(model=str(model_dir), dtype="float32", skip_tokenizer_init=True)
    config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
    with pytest.MonkeyPatch.context() as patch, set_current_vllm_config(config):
        import vllm.model_executor.models.qwen2 as vllm_qwen2_module

        patch.setattr(vllm_qwen2_module, "Attention", StandInAttention)
        model = vllm_qwen2_module.Qwen2ForCausalLM(vllm_config=config)
        source = policy.load_model(model_dir)
        with torch.no_grad():
            for p in source.parameters():  # no zero biases or unit norms: every loaded tensor must show
                p.normal_()
        yield model, model_config, source


def test_version():
    assert vllm.__version__ == "0.32.0"


def test_llm_kwargs_are_real_llm_or_engine_args(model_dir):
    kwargs = llm_kwargs(model_dir, max_num_batched_tokens=4096)  # an extra passed through **llm_kwargs
    named = inspect.signature(LLM.__init__).parameters
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(kwargs) - set(named) - engine_fields == set()
    args = EngineArgs(**kwargs)  # LLM.__init__ forwards everything to EngineArgs
    assert (args.distributed_executor_backend, args.enable_sleep_mode, args.logprobs_mode) == (
        "external_launcher", True, "processed_logprobs")
    # The model config validates dtype, logprobs_mode and max_model_len for real; sleep mode needs a GPU platform.
    config = dataclasses.replace(args, enable_sleep_mode=False).create_model_config()
    assert (config.logprobs_mode, config.dtype, config.max_model_len) == ("processed_logprobs", torch.float32, 256)
    with pytest.raises(Exception, match="Sleep mode is not supported on current platform"):
        args.create_model_config()


def test_external_launcher_keeps_the_engine_in_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    ParallelConfig(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_sampling_params(temperature):
    sampling = engines.Sampling(max_new_tokens=9, temperature=temperature, top_p=0.95, top_k=0, stop_token_ids=[2])
    params = SamplingParams(**engines.vllm_sampling_kwargs(sampling))
    assert (params.n, params.max_tokens, params.logprobs, params.flat_logprobs, params.detokenize) == (1, 9, 0, True,
                                                                                                       False)
    assert params.stop_token_ids == [2] and params.top_k == 0
    assert params.sampling_type == (SamplingType.GREEDY if temperature == 0 else SamplingType.RANDOM)
    assert params.seed is None
    seeded = SamplingParams(**engines.vllm_sampling_kwargs(sampling, seed=2**62 + 5))  # derive_seed's 63 bits
    assert seeded.seed == 2**62 + 5
    if temperature > 0:
        assert seeded.sampling_type == SamplingType.RANDOM_SEED  # its own generator in vLLM's sampler


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def test_tokens_prompt_keys():
    hints = typing.get_type_hints(TokensPrompt)
    image = png(40, 30)
    for prompt in (engines.vllm_prompt([1, 2, 3]), engines.vllm_prompt([1, 2], images=[image])):
        assert TokensPrompt.__required_keys__ <= set(prompt) <= set(hints)
        assert TokensPrompt(**prompt) == prompt
    assert prompt["multi_modal_uuids"] == {"image": [hashlib.sha256(image).hexdigest()]}
    assert isinstance(prompt["multi_modal_data"]["image"][0], Image.Image)


def test_banned_tokens_as_logit_bias():
    params = SamplingParams(**engines.vllm_sampling_kwargs(engines.Sampling(), banned_token_ids=[5, 6]))
    assert params.logit_bias == {5: -100.0, 6: -100.0}


def test_stop_strings_keep_the_completing_token_in_vllms_detokenizer(tmp_path):
    """kiln's stop strings through vLLM's own incremental detokenizer (what its output processor runs on every
    step's tokens): the ids end with the token that completes </code>, that token whole though the text goes on,
    whether the tokens arrive one per step or several at once (speculative decoding), as HFEngine and chat.code_stop
    end them."""
    text = "<code>```python\nprint(1)\n```</code>\nI think it is 7."
    tokenizer = policy.load_tokenizer(tiny.make_tiny_model(tmp_path, [text] * 20))
    params = SamplingParams(**engines.vllm_sampling_kwargs(engines.Sampling(stop=["</code>"], stop_token_ids=[2])))
    assert (params.stop, params.include_stop_str_in_output, params.detokenize) == (["</code>"], True, True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    kept = chat.code_stop(tokenizer, ids)
    assert tokenizer.decode(ids[kept - 1 : kept]).startswith(">") and tokenizer.decode(ids[kept - 1 : kept]) != ">"
    request = types.SimpleNamespace(request_id="r", prompt_token_ids=[1], sampling_params=params)
    one_by_one = IncrementalDetokenizer.from_new_request(tokenizer, request)
    assert uses_fast_detokenizer(tokenizer)
    stops = [one_by_one.update([token], stop_terminated=False) for token in ids[:kept]]
    assert stops == [None] * (kept - 1) + ["</code>"] and one_by_one.output_token_ids == ids[:kept]
    at_once = IncrementalDetokenizer.from_new_request(tokenizer, request)
    assert at_once.update(ids, stop_terminated=False) == "</code>" and at_once.output_token_ids == ids[:kept]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return tiny.make_tiny_vlm(tmp_path_factory.mktemp("tiny-qwen2_5_vl"), ["<answer>red</answer> It is 3."] * 50)


@pytest.fixture(scope="module")
def vllm_qwen25_vl(vl_dir, vllm_parallel_state):
    """(vLLM's Qwen2_5_VLForConditionalGeneration on CPU, its ModelConfig, kiln's policy model as weight source)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_registry, "_run_in_subprocess", lambda fn: fn())  # the model inspection, in process
        model_config = ModelConfig(model=str(vl_dir), dtype="float32", skip_tokenizer_init=True)
        config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
        with set_current_vllm_config(config):
            import vllm.model_executor.models.qwen2 as vllm_qwen2_module
            import vllm.model_executor.models.qwen2_5_vl as vllm_qwen25_vl_module

            patch.setattr(vllm_qwen2_module, "Attention", StandInAttention)
            patch.setattr(vllm_qwen25_vl_module, "MMEncoderAttention", StandInAttention)
            model = vllm_qwen25_vl_module.Qwen2_5_VLForConditionalGeneration(vllm_config=config)
            source = policy.load_model(vl_dir)
            with torch.no_grad():
                for p in source.parameters():
                    p.normal_()
            yield model, model_config, source, vllm_qwen25_vl_module


def test_qwen25_vl_weight_names(vllm_qwen25_vl):
    """policy.iter_full_weights of a Qwen2.5-VL (model.visual.*, model.language_model.*) fills every parameter of
    vLLM 0.32's Qwen2.5-VL through its own name mapping; the tied flag is only in the top-level config."""
    model, model_config, source, _ = vllm_qwen25_vl
    assert model_config.hf_config.tie_word_embeddings and not getattr(model_config.hf_text_config,
                                                                      "tie_word_embeddings", None)
    loaded = set()
    for bucket in engines.bucket_weights(((n, t) for n, t in policy.iter_full_weights(source)
                                          if n != "lm_head.weight"), cap_bytes=20_000):
        loaded |= model.load_weights(bucket)
    params = dict(model.named_parameters())
    assert loaded == set(params)
    assert torch.equal(params["visual.patch_embed.proj.weight"], source.model.visual.patch_embed.proj.weight)
    assert torch.equal(params["visual.blocks.1.attn.qkv.weight"], source.model.visual.blocks[1].attn.qkv.weight)
    embed = source.model.language_model.embed_tokens.weight
    assert torch.equal(params["language_model.model.embed_tokens.weight"][: embed.shape[0]], embed)


def test_image_token_count_is_vllms(vllm_qwen25_vl, vl_dir):
    """vLLM's own count of an image's tokens (what it expands a placeholder to) equals vision.image_tokens, which
    the HF engine and trainer expand by, for odd sizes, a scaled-up thin image and a long one."""
    from vllm.multimodal.processing import InputProcessingContext

    _, model_config, _, module = vllm_qwen25_vl
    info = module.Qwen2_5_VLProcessingInfo(InputProcessingContext(model_config, tokenizer=None))
    # its HF processor needs torchvision's video processor; the image kwargs it would route are none here
    info.__dict__["supported_mm_processor_kwargs"] = {}
    processor = vision.image_processor(str(vl_dir))
    for width, height in [(91, 37), (201, 300), (40, 10), (2800, 28), (640, 480)]:
        fitted = vision.load_image(png(width, height))
        want = info.get_num_image_tokens(image_width=fitted.width, image_height=fitted.height,
                                         image_processor=processor, mm_kwargs={})
        assert vision.image_tokens(processor, fitted) == want, (width, height)


def test_bucketed_load_through_the_real_vllm_qwen2(vllm_qwen2):
    model, _, source = vllm_qwen2
    loaded = set()
    state = {n: t for n, t in source.state_dict().items() if n != "lm_head.weight"}
    buckets = list(engines.bucket_weights(state.items(), cap_bytes=20_000))
    assert len(buckets) > 5
    for bucket in buckets:  # q/k/v and gate/up arrive in separate calls: vLLM stacks each shard as it comes
        loaded |= model.load_weights(bucket)
    assert loaded == {name for name, _ in model.named_parameters()}
    params, attn, mlp = dict(model.named_parameters()), source.model.layers[1].self_attn, source.model.layers[1].mlp
    assert torch.equal(params["model.layers.1.self_attn.qkv_proj.weight"],
                       torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(params["model.layers.1.mlp.gate_up_proj.weight"],
                       torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    embed = source.model.embed_tokens.weight  # vLLM pads the vocabulary (301 -> 320 rows here)
    assert torch.equal(params["model.embed_tokens.weight"][: embed.shape[0]], embed)


def test_tied_lm_head_alone_in_a_call_is_refused(vllm_qwen2):
    """Why VLLMEngine never sends a tied lm_head: vLLM 0.32 raises when it comes without its embedding."""
    model, _, source = vllm_qwen2
    with pytest.raises(ValueError, match="'lm_head.weight' was skipped because it is tied"):
        model.load_weights([("lm_head.weight", source.lm_head.weight.detach())])


class RecordingLLM:
    """Stands in for `vllm.LLM`: binds every call to the real signature, records it, and acts on a real model."""

    model = None
    model_config = None

    def __init__(self, **kwargs):
        extra = inspect.signature(LLM.__init__).bind(self, **kwargs).arguments.get("kwargs", {})
        assert set(extra) <= {f.name for f in dataclasses.fields(EngineArgs)}, extra
        self.kwargs, self.calls = kwargs, []
        assert callable(LLMEngine.reset_encoder_cache)
        assert "hf_text_config" in {f.name for f in dataclasses.fields(ModelConfig)}
        self.llm_engine = type("Engine", (), {})()
        self.llm_engine.model_config = self.model_config
        self.llm_engine.reset_encoder_cache = lambda: self._record(LLMEngine.reset_encoder_cache, "reset_encoder_cache")
        self.llm_engine.add_request = self._add_request
        self.llm_engine.step = self._step
        self.llm_engine.abort_request = self._abort_request
        self.llm_engine.add_lora = self._add_lora
        self.scheduled = {}  # request id -> (prompt, params, tokens so far, logprobs)

    def _record(self, real, name, *args, **kwargs):
        inspect.signature(real).bind(self, *args, **kwargs)
        self.calls.append((name, args, kwargs))

    def apply_model(self, func):
        self._record(LLM.apply_model, "apply_model", func)
        return [func(self.model)]  # what the worker does: func(worker.get_model()), one worker per process

    def wake_up(self, tags=None):
        assert tags is None or set(tags) <= SLEEP_TAGS, tags
        self._record(LLM.wake_up, "wake_up", tags)
        return True

    def sleep(self, level=1, mode="abort"):
        assert level in (0, 1, 2)
        self._record(LLM.sleep, "sleep", level=level)

    def reset_prefix_cache(self, *args, **kwargs):
        self._record(LLM.reset_prefix_cache, "reset_prefix_cache", *args, **kwargs)
        return True

    def generate(self, prompts, sampling_params=None, **kwargs):
        self._record(LLM.generate, "generate", prompts, sampling_params, **kwargs)
        assert isinstance(sampling_params, SamplingParams)
        outputs = []
        for i, prompt in enumerate(prompts):
            token_ids, logprobs = [], self._new_logprobs(prompt, sampling_params)
            for step in range(sampling_params.max_tokens):
                if self._draw(prompt, sampling_params, token_ids, logprobs):
                    break
            outputs.append(self._output(str(i), prompt, sampling_params, token_ids, logprobs, finished=True))
        return outputs

    def _add_request(self, request_id, prompt, params, *args, **kwargs):
        """LLMEngine.add_request: the request joins the scheduler and draws a token at each step() from then on."""
        self._record(LLMEngine.add_request, "add_request", request_id, prompt, params, *args, **kwargs)
        assert isinstance(request_id, str) and request_id not in self.scheduled and isinstance(params, SamplingParams)
        self.scheduled[request_id] = (prompt, params, [], self._new_logprobs(prompt, params))

    def _step(self):
        """LLMEngine.step: one token for every scheduled request; a FINAL_ONLY request is output once finished."""
        self._record(LLMEngine.step, "step")
        outputs = []
        for request_id, (prompt, params, token_ids, logprobs) in list(self.scheduled.items()):
            finished = self._draw(prompt, params, token_ids, logprobs) or len(token_ids) == params.max_tokens
            if finished:
                del self.scheduled[request_id]
            if finished or params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._output(request_id, prompt, params, token_ids, logprobs, finished))
        return outputs

    def _add_lora(self, lora_request):
        """LLMEngine.add_lora: what the worker's LoRA manager reads is the request's folder (recorded here)."""
        self._record(LLMEngine.add_lora, "add_lora", lora_request)
        assert isinstance(lora_request, LoRARequest) and os.path.isfile(
            os.path.join(lora_request.lora_path, "adapter_model.safetensors"))
        return True

    def _abort_request(self, request_ids, *args, **kwargs):
        self._record(LLMEngine.abort_request, "abort_request", request_ids, *args, **kwargs)
        for request_id in request_ids:
            del self.scheduled[request_id]

    @staticmethod
    def _new_logprobs(prompt, params):
        assert TokensPrompt.__required_keys__ <= set(prompt) <= set(typing.get_type_hints(TokensPrompt))
        logprobs = create_sample_logprobs(params.flat_logprobs)
        assert isinstance(logprobs, FlatLogprobs)  # what kiln asks for: no dict per token
        return logprobs

    @staticmethod
    def _draw(prompt, params, token_ids, logprobs) -> bool:
        """The next token of a request (a function of its prompt's last id and the step), in vLLM's logprob layout;
        whether it is a stop token."""
        step = len(token_ids)
        token = (prompt["prompt_token_ids"][-1] + step + 1) % 8  # 7 -> 0: stop token 0 below
        # vLLM's layout: the sampled token, then the top `logprobs` ones (none for logprobs=0)
        append_logprobs_for_next_position(logprobs, [token], [-0.5 - step], [None], rank=1,
                                          num_logprobs=params.logprobs)
        token_ids.append(token)
        return token in params.stop_token_ids

    @staticmethod
    def _output(request_id, prompt, params, token_ids, logprobs, finished):
        finish = ("stop" if token_ids[-1] in params.stop_token_ids else "length") if finished else None
        completion = CompletionOutput(index=0, text="", token_ids=list(token_ids), cumulative_logprob=None,
                                      logprobs=logprobs, finish_reason=finish)
        return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompt["prompt_token_ids"],
                             prompt_logprobs=None, outputs=[completion], finished=finished)


def test_vllm_engine_against_the_real_api(vllm_qwen2, model_dir, monkeypatch):
    model, model_config, source = vllm_qwen2
    monkeypatch.setattr(RecordingLLM, "model", model)
    monkeypatch.setattr(RecordingLLM, "model_config", model_config)
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    engine = engines.VLLMEngine(str(model_dir), seed=7, dtype="float32", max_model_len=256,
                                sync_bucket_bytes=30_000, max_num_batched_tokens=4096)
    llm = engine.llm
    assert llm.kwargs == llm_kwargs(model_dir, seed=7, max_num_seqs=256, enforce_eager=False,
                                    max_model_len=256, max_num_batched_tokens=4096)
    assert engine.tied_lm_head  # read from vLLM's own model config
    engine.sleep()
    engine.wake_up()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # what a level-2 sleep leaves behind, as far as kiln may assume
    engine.load_weights(policy.iter_full_weights(source))  # exactly what the trainer streams
    embed = source.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight[: embed.shape[0]], embed)
    assert all(p.abs().sum() > 0 for p in model.parameters())
    sampling = engines.Sampling(max_new_tokens=4, temperature=0.7, stop_token_ids=[0])
    completions = engine.generate([[1, 2, 3], [6]], sampling)
    assert [(c.token_ids, c.finish_reason) for c in completions] == [([4, 5, 6, 7], "length"), ([7, 0], "stop")]
    assert completions[1].logprobs == [-0.5, -1.5]
    engine.sleep()
    names = [name for name, _, _ in llm.calls]
    loads = names.count("apply_model") - 1  # the first one read the parameter names
    assert loads == engine.last_metrics["vllm/sync_buckets"] > 1
    assert names == (["apply_model", "sleep", "wake_up"] + ["apply_model"] * loads
                     + ["wake_up", "reset_prefix_cache", "reset_encoder_cache", "generate", "sleep"])
    wakes = [args[0] for name, args, _ in llm.calls if name == "wake_up"]
    assert wakes == [["weights"], ["kv_cache"]]
    assert [kwargs for name, _, kwargs in llm.calls if name == "sleep"] == [{"level": 2}, {"level": 2}]
    prompts = next(args[0] for name, args, _ in llm.calls if name == "generate")
    assert prompts[1] == {"prompt_token_ids": [6]}


def test_vllm_engine_continuous_batching_against_the_real_api(vllm_qwen2, model_dir, monkeypatch):
    """VLLMEngine.submit/step through LLMEngine.add_request/step (bound to vLLM 0.32's signatures): requests join at
    any step, only finished ones come back (RequestOutputKind.FINAL_ONLY), each under its key with its own seed and
    budget; generate() and sleep() refuse while requests are unfinished; abort() empties the scheduler."""
    model, model_config, source = vllm_qwen2
    monkeypatch.setattr(RecordingLLM, "model", model)
    monkeypatch.setattr(RecordingLLM, "model_config", model_config)
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    engine = engines.VLLMEngine(str(model_dir), seed=7, dtype="float32", max_model_len=256)
    assert engines.continuous(engine)
    llm = engine.llm
    engine.submit(("traj", 0), [1, 2, 3], engines.Sampling(max_new_tokens=4, stop_token_ids=[0]), seed=5)
    engine.submit(("traj", 1), [6], engines.Sampling(max_new_tokens=4, stop_token_ids=[0]), seed=6)
    assert engine.step() == []  # nothing finished after one token each
    finished = engine.step()  # [6] drew 7 then 0, a stop token
    assert [(key, c.token_ids, c.finish_reason, c.logprobs) for key, c in finished] == \
        [(("traj", 1), [7, 0], "stop", [-0.5, -1.5])]
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.generate([[1]], engines.Sampling(max_new_tokens=1))
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.sleep()
    engine.submit(("traj", 2), [3], engines.Sampling(max_new_tokens=1), seed=8)  # joins mid-way
    assert [(key, c.token_ids, c.finish_reason) for key, c in engine.step()] == [(("traj", 2), [4], "length")]
    assert [(key, c.token_ids, c.finish_reason) for key, c in engine.step()] == [(("traj", 0), [4, 5, 6, 7], "length")]
    added = [args for name, args, _ in llm.calls if name == "add_request"]
    assert [prompt for _, prompt, _ in added] == [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [6]},
                                                  {"prompt_token_ids": [3]}]
    assert [(p.seed, p.max_tokens) for _, _, p in added] == [(5, 4), (6, 4), (8, 1)]
    assert {p.output_kind for _, _, p in added} == {RequestOutputKind.FINAL_ONLY}
    assert engine.step() == [] and not engine.submitted
    engine.submit(("traj", 3), [2], engines.Sampling(max_new_tokens=8))
    engine.abort()  # a failed rollout: the scheduler is emptied
    assert llm.calls[-1] == ("abort_request", (["3"],), {}) and llm.scheduled == {} and not engine.submitted
    engine.sleep()


def test_image_budget_reaches_the_model_config(vl_dir, monkeypatch):
    monkeypatch.setattr(vllm_registry, "_run_in_subprocess", lambda fn: fn())
    args = EngineArgs(**llm_kwargs(vl_dir, max_images_per_prompt=5))
    config = dataclasses.replace(args, enable_sleep_mode=False).create_model_config()
    assert config.multimodal_config.get_limit_per_prompt("image") == 5
    assert config.multimodal_config.get_limit_per_prompt("video") == 0


ALL_LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def lora_policy(model_dir, rank: int = 8):
    """kiln's policy with LoRA adapters (all-linear), B made non-zero so that every adapter shows."""
    model = policy.add_lora(policy.load_model(model_dir), rank, 2.0 * rank, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    return model


def test_lora_engine_args(model_dir):
    """--lora-rank 12 asks vLLM for one adapter slot of rank 16 (the next rank vLLM 0.32 allows), which its
    LoRAConfig accepts; a rank past vLLM's largest is refused before the engine starts."""
    kwargs = llm_kwargs(model_dir, lora_rank=12)
    args = EngineArgs(**kwargs)
    assert (args.enable_lora, args.max_lora_rank, args.max_loras) == (True, 16, 1)
    LoRAConfig(max_lora_rank=args.max_lora_rank, max_loras=args.max_loras)
    assert "enable_lora" not in llm_kwargs(model_dir)
    with pytest.raises(ValueError, match="vLLM serves LoRA ranks up to 512"):
        llm_kwargs(model_dir, lora_rank=600)


def test_adapter_folder_is_what_vllms_lora_loader_reads(model_dir, tmp_path, monkeypatch):
    """engines.write_adapter's folder through vLLM 0.32's own PEFTHelper and LoRAModel.from_local_checkpoint (what
    its worker's LoRA manager runs for a LoRARequest): every adapted layer of the policy arrives, A and B as the
    policy holds them, scaled alpha / r. (Host memory is pinned only where an accelerator is: none here.)"""
    monkeypatch.setattr(vllm_lora_model, "PIN_MEMORY", False)
    model = lora_policy(model_dir)
    nbytes = engines.write_adapter(tmp_path / "v1", policy.iter_adapter_weights(model), policy.lora_config(model),
                                   torch.float32)
    adapters = dict(policy.iter_adapter_weights(model))
    assert nbytes == sum(t.nbytes for t in adapters.values())
    helper = PEFTHelper.from_local_dir(str(tmp_path / "v1"), max_position_embeddings=256)
    helper.validate_legal(LoRAConfig(max_lora_rank=8))
    assert (helper.r, helper.lora_alpha, set(helper.target_modules)) == (8, 16, ALL_LINEAR)
    loaded = LoRAModel.from_local_checkpoint(str(tmp_path / "v1"), ALL_LINEAR, helper, lora_model_id=1,
                                             device="cpu", dtype=torch.float32)
    layers = {name.removesuffix(".lora_A.default.weight") for name in adapters if ".lora_A." in name}
    assert set(loaded.loras) == layers
    for layer in layers:
        weights = loaded.loras[layer]
        assert torch.equal(weights.lora_a, adapters[f"{layer}.lora_A.default.weight"])
        assert torch.equal(weights.lora_b, adapters[f"{layer}.lora_B.default.weight"])
        assert weights.scaling == 2.0


def test_vllm_engine_syncs_adapters_as_lora_requests(vllm_qwen2, model_dir, monkeypatch):
    """A LoRA policy's VLLMEngine: level-1 sleeps (the base stays), each load_adapter writes a new folder that
    LLMEngine.add_lora reloads in place into slot 1, requests carry the stored LoRARequest (without load_inplace,
    which would reload it for every request), the previous folder goes, the prefix cache is reset."""
    model, model_config, _ = vllm_qwen2
    monkeypatch.setattr(RecordingLLM, "model", model)
    monkeypatch.setattr(RecordingLLM, "model_config", model_config)
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    engine = engines.VLLMEngine(str(model_dir), seed=7, dtype="float32", max_model_len=256, lora_rank=8)
    llm, source = engine.llm, lora_policy(model_dir)
    assert (llm.kwargs["enable_lora"], llm.kwargs["max_lora_rank"]) == (True, 8) and engine.holds_base
    paths = []
    for _ in range(2):
        engine.sleep()
        engine.wake_up()
        engine.load_adapter(policy.iter_adapter_weights(source), policy.lora_config(source))
        request = next(args[0] for name, args, _ in reversed(llm.calls) if name == "add_lora")
        assert (request.lora_name, request.lora_int_id, request.load_inplace) == ("kiln", 1, True)
        assert engine.lora_request.lora_path == request.lora_path and not engine.lora_request.load_inplace
        paths.append(request.lora_path)
        engine.generate([[1, 2, 3]], engines.Sampling(max_new_tokens=2))
        engine.submit("k", [4], engines.Sampling(max_new_tokens=1))
        while engine.submitted:
            engine.step()
    assert paths[0] != paths[1] and not os.path.exists(paths[0]) and os.path.isdir(paths[1])
    generated = [kwargs["lora_request"] for name, _, kwargs in llm.calls if name in ("generate", "add_request")]
    assert [r.lora_path for r in generated] == [paths[0], paths[0], paths[1], paths[1]]
    assert [kwargs for name, _, kwargs in llm.calls if name == "sleep"] == [{"level": 1}, {"level": 1}]
    names = [name for name, _, _ in llm.calls]
    assert names.count("reset_prefix_cache") == 2 and "apply_model" not in names[1:]  # no base weights sent
    assert engine.last_metrics["vllm/sync_bytes"] == sum(t.nbytes for _, t in policy.iter_adapter_weights(source))
