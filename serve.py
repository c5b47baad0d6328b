"""kiln's token-recording endpoint (agent_server.py) alone over a model, to run any OpenAI-speaking agent against a
checkpoint; one endpoint per rank under torchrun, on port + rank:

    python serve.py --model runs/grpo/best --port 8000
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

import agent_server
import chat
import cli
import hub
import policy
from engines import Sampling
from generate import GenerateArgs, hf_folder, load_generator


@dataclass
class ServeArgs:
    model: str
    """a Hugging Face folder or hub name, or a kiln checkpoint folder (<output_dir>/checkpoints/step_*)"""
    engine: Literal["hf", "vllm"] = "hf"
    """vLLM on GPUs, or the model's own Hugging Face decoding loop (CPU, debugging)"""
    port: int = 8000
    """port of rank 0's endpoint (rank r serves on port + r; 0 = any free port, printed)"""
    host: str = "127.0.0.1"
    """address to bind (0.0.0.0 exposes the endpoint to the network)"""
    seed: int = 0
    """sampling seed (each rank draws from seed + rank)"""
    max_new_tokens: int = 1024
    """reply budget when a request names no max_tokens"""
    max_total_tokens: int = 32768
    """prompt + reply per request; a longer conversation gets a context_length_exceeded error"""
    temperature: float | None = None
    """sample every request at this temperature (and --top-p); default: what each request asks (OpenAI's default 1)"""
    top_p: float = 1.0
    """nucleus sampling with --temperature"""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """weights on GPUs (the HF engine on CPU always computes in float32)"""
    end_of_turn: str | None = None
    """token that closes an assistant turn (default: found in the chat template, e.g. <|im_end|>, <|eot_id|>)"""
    vllm_gpu_memory_utilization: float = 0.85
    """fraction of GPU memory vLLM may take"""
    vllm_max_model_len: int = 32768
    """vLLM context length"""
    vllm_tensor_parallel_size: int = 1
    """ranks per vLLM engine (consecutive ranks form a group; needs --temperature: peers sample alike)"""


def serve(args: ServeArgs) -> None:
    """agent_server's endpoint over args.model until interrupted; every rank ticks its engine together."""
    if args.vllm_tensor_parallel_size > 1 and args.temperature is None:
        raise ValueError("--vllm-tensor-parallel-size > 1 needs --temperature: the ranks of an engine sample together")
    rank, world, device = policy.init_distributed()
    torch.manual_seed(args.seed + rank)
    named, args.model = args.model, hub.fetch(args.model, "--model")  # a hub name: downloaded once per node
    hf_dir = hf_folder(args.model)
    tokenizer = policy.load_tokenizer(hf_dir)
    engine = load_generator(GenerateArgs(
        model=args.model, data="", engine=args.engine, seed=args.seed, dtype=args.dtype,
        vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization, vllm_max_model_len=args.vllm_max_model_len,
        vllm_tensor_parallel_size=args.vllm_tensor_parallel_size), tokenizer, device)
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature or 0.0, top_p=args.top_p,
                        stop_token_ids=policy.stop_token_ids(tokenizer, hf_dir,
                                                             chat.end_of_turn(tokenizer, args.end_of_turn)))
    port = args.port + rank if args.port else 0
    with agent_server.AgentServer(engine, tokenizer, sampling, args.end_of_turn, args.max_total_tokens,
                                  fixed_sampling=args.temperature is not None, host=args.host, port=port,
                                  model_name=named) as server:
        print(f"rank {rank}: serving {named} at {server.base_url} (sessions: Authorization: Bearer <key>; "
              f"recorded tokens: GET /kiln/sessions/<key>)", flush=True)
        try:
            while True:
                server.step()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    with cli.one_line_errors():
        serve(cli.parse_args(ServeArgs))
    policy.exit_distributed()
