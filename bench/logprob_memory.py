"""Peak memory of chosen-token logprobs, forward + backward, at Qwen2.5's vocabulary (152,064): kiln's chunked
`policy.packed_logprobs` against the naive full-vocabulary log_softmax. CPU; each measurement runs in a fresh
subprocess and reads the kernel's peak-RSS counter (VmHWM, reset through /proc/self/clear_refs) around one
forward + backward, after a warm-up, so imports, the model and the inputs are not counted.

    .venv/bin/python bench/logprob_memory.py [--tokens 4096] [--hidden 64]
"""

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Args:
    tokens: tuple[int, ...] = (2048, 4096)
    """total packed tokens per measurement (4 sequences each)"""
    vocab: int = 152064
    """vocabulary size (Qwen2.5's)"""
    hidden: int = 64
    """hidden size of the 1-layer Qwen2 model (small: the head's logits dominate, as at 7B scale)"""
    chunk_size: int = 512
    """packed_logprobs chunk size (its default)"""
    with_entropy: bool = False
    """also compute (and backpropagate) the entropy"""


def measure(method: str, tokens: int, vocab: int, hidden: int, chunk_size: int, with_entropy: bool) -> dict:
    """Runs in the subprocess: peak extra RSS (bytes) and seconds of one forward + backward."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import policy

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    sequences = [torch.randint(vocab, (tokens // 4,)).tolist() for _ in range(4)]

    def step(seqs):
        if method == "chunked":
            logprobs, entropy = policy.packed_logprobs(model, seqs, chunk_size=chunk_size, with_entropy=with_entropy)
        else:  # the full [tokens, vocab] fp32 log_softmax, then the chosen tokens
            ids = torch.tensor([[t for s in seqs for t in s]])
            positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
            logp = torch.log_softmax(logits.float(), dim=-1)
            logprobs = logp[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
            entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
        loss = logprobs.sum() + (entropy.sum() if entropy is not None else 0)
        loss.backward()
        model.zero_grad(set_to_none=True)

    step([s[:64] for s in sequences])  # warm-up: lazy initialisation, thread pools, gradient buffers
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    baseline = rss("VmRSS")
    start = time.perf_counter()
    step(sequences)
    return {"peak_bytes": rss("VmHWM") - baseline, "seconds": time.perf_counter() - start}


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def run(method: str, tokens: int, args: Args) -> dict:
    code = (f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'bench')!r}); "
            f"from logprob_memory import measure; print(json.dumps(measure({method!r}, {tokens}, {args.vocab}, "
            f"{args.hidden}, {args.chunk_size}, {args.with_entropy})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(args: Args) -> None:
    print(f"vocab {args.vocab}, hidden {args.hidden}, chunk {args.chunk_size}, entropy {args.with_entropy}, "
          "forward + backward, peak RSS above the warmed-up baseline")
    print("| tokens | naive log_softmax | chunked packed_logprobs | ratio | naive s | chunked s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        naive, chunked = run("naive", tokens, args), run("chunked", tokens, args)
        mib = 2**20
        print(f"| {tokens} | {naive['peak_bytes'] / mib:.0f} MiB | {chunked['peak_bytes'] / mib:.0f} MiB | "
              f"1/{naive['peak_bytes'] / chunked['peak_bytes']:.1f} | {naive['seconds']:.2f} | "
              f"{chunked['seconds']:.2f} |", flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
