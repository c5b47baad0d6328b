"""train_grpo.py and train_ppo.py are copied-and-edited scripts (CleanRL style), so their Args are two copies: every
field both have must mean the same and default the same, except where the algorithms differ. Those exceptions are
listed here with the reason; a new divergence fails until it is either undone or listed."""

import ast
import dataclasses
import inspect

import train_grpo
import train_ppo

# field -> why PPO's default (and docstring) differ from GRPO's
ALGORITHMIC = {
    "output_dir": "each trainer writes to its own folder by default",
    "group_size": "GRPO's baseline is the group (needs >= 2); PPO's is the critic (1 = classic PPO)",
    "clip_low": "GRPO's default follows --policy-loss (GSPO clips a sequence ratio); PPO has one loss",
    "clip_high": "as clip_low",
    "kl_coef": "GRPO adds the KL to the loss; PPO subtracts it from the token rewards",
    "kl_estimator": "the reward penalty uses k1 (verl's PPO); the loss term k3 (GRPO)",
    "minibatches": "PPO updates two models per batch in several minibatches; GRPO defaults to on-policy",
    "total_steps": "PPO can count epochs over its rows (--epochs) instead of steps",
    "lr": "PPO's is the actor's (the critic has --critic-lr); GRPO's has warm-up and a schedule",
    "weight_decay": "PPO's applies to both models",
    "max_grad_norm": "PPO's applies to both models",
    "keep_checkpoints": "PPO keeps as many critic checkpoints too",
    "tools": "PPO's critic has no vision model: no codev toolbox",
}


def fields(cls) -> dict[str, tuple[object, object, str]]:
    """name -> (type, default, docstring) of a dataclass whose fields each carry a docstring line."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {node.target.id: after.value.value for node, after in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)}
    return {f.name: (f.type, f.default, docs.get(f.name, "")) for f in dataclasses.fields(cls)}


def test_shared_fields_mean_and_default_the_same():
    grpo, ppo = fields(train_grpo.Args), fields(train_ppo.Args)
    shared = sorted(set(grpo) & set(ppo))
    assert len(shared) >= 45, shared  # the copies share most of their fields
    diverged = [name for name in shared if grpo[name] != ppo[name] and name not in ALGORITHMIC]
    assert not diverged, {name: (grpo[name], ppo[name]) for name in diverged}
    same_anyway = [name for name in ALGORITHMIC if name in shared and grpo[name] == ppo[name]]
    assert not same_anyway, f"listed as different but identical now: {same_anyway}"


def test_every_field_has_a_docstring_line():
    for cls in (train_grpo.Args, train_ppo.Args):
        missing = [name for name, (_, _, doc) in fields(cls).items() if not doc.strip()]
        assert not missing, (cls.__module__, missing)
