"""The three trainers, one after the other, on 2 ranks: GRPO and PPO with a reward a random model earns in part (the
fraction of characters that are 'x', so that advantages and gradients are not zero), then SFT on the rows' solutions:

    torchrun --nproc-per-node 2 tests/dist_trainers_sp.py MODEL_DIR DATA CONVERSATIONS OUT_DIR SEQUENCE_PARALLEL

Writes OUT_DIR/grpo, OUT_DIR/ppo and OUT_DIR/sft (metrics.jsonl each); tests/test_sequence_parallel.py compares the
runs.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

import policy
import train_grpo
import train_ppo
import train_sft


@dataclass
class Score:
    score: float
    info: dict


def x_fraction(rows, texts, sample_infos=None):
    return [Score(t.count("x") / max(1, len(t)), {}) for t in texts]


def main(model_dir: str, data: str, conversations: str, out: str, sequence_parallel: str) -> None:
    common = dict(model=model_dir, data=data, prompts_per_step=2, group_size=2, max_new_tokens=24, total_steps=2,
                  save_every=0, sample_every=0, seed=1, sequence_parallel=int(sequence_parallel), minibatches=1)
    train_grpo.main(train_grpo.Args(output_dir=str(Path(out, "grpo")), **common), score_fn=x_fraction)
    train_ppo.main(train_ppo.Args(output_dir=str(Path(out, "ppo")), critic_warmup_steps=0, **common),
                   score_fn=x_fraction)
    train_sft.main(train_sft.Args(model=model_dir, data=conversations, output_dir=str(Path(out, "sft")), steps=2,
                                  batch_size=4, sequence_parallel=int(sequence_parallel)))
    policy.exit_distributed(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
