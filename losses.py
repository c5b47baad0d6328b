"""RL math for kiln: advantages, GAE, policy/value losses, KL estimators, loss aggregation, masked sums and means.

Pure torch functions, no model code. Shapes: `rewards`/`group` are per sample [N]; token tensors are [B, T] with a
loss `mask` [B, T] (1 = token produced by the policy, 0 = prompt, tool output, padding). Functions that take a mask
return 0 where mask = 0 and let nothing from there (padding may hold -inf) reach the values or the gradients.
"""

import math

import torch

# ---------------------------------------------------------------------------------------------------- masked statistics


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x where mask is 1 (over `dim`, or everything)."""
    x = torch.where(mask.bool(), x, 0)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x where mask is 1; 0 where nothing is masked in (an empty mean is 0, not NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


# ---------------------------------------------------------------------------------------------- per-sample advantages


def _group_stats(rewards: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sample's group mean, unbiased group std (0 for a group of one) and group size, all [N].

    In float64: the mean of G equal float32 rewards is then exactly that reward, so a constant group's deviations,
    std and advantages are exactly 0 (in float32 they can be 1e-8 / 1e-8 = O(1) noise)."""
    _, index, counts = torch.unique(group, return_inverse=True, return_counts=True)
    x, counts = rewards.double(), counts.double()
    mean = x.new_zeros(len(counts)).index_add_(0, index, x) / counts
    square = x.new_zeros(len(counts)).index_add_(0, index, (x - mean[index]) ** 2)
    std = (square / (counts - 1).clamp(min=1)).sqrt()
    return tuple(t[index].to(rewards.dtype) for t in (mean, std, counts))


def grpo_advantages(rewards: torch.Tensor, group: torch.Tensor, normalize_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO (DeepSeekMath, arXiv 2402.03300): A_i = (r_i - mean_g) / (std_g + eps), unbiased group std. [N] -> [N].

    A zero-variance group, and a group of one, gets A = 0 (no relative signal)."""
    mean, std, _ = _group_stats(rewards, group)
    return (rewards - mean) / (std + eps) if normalize_std else rewards - mean


def drgrpo_advantages(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (arXiv 2503.20783): A_i = r_i - mean_g, no std division. [N] -> [N].

    Its other half is length-unbiased aggregation: use aggregate(..., "seq-mean-token-sum-norm", max_len=<constant>)."""
    return grpo_advantages(rewards, group, normalize_std=False)


def rloo_advantages(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """RLOO (arXiv 2402.14740): A_i = r_i - mean_{j != i in g} r_j = G/(G-1) (r_i - mean_g). A group of one gets 0."""
    mean, _, size = _group_stats(rewards, group)
    return torch.where(size > 1, (rewards - mean) * size / (size - 1).clamp(min=1), 0)


def reinforce_pp_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262): rewards whitened over the whole batch, (x - mean) / (std + eps), unbiased std.
    Normalised per sample, not per token. [N] -> [N]."""
    x = rewards.double()  # float64 for the same reason as in _group_stats
    std = x.std() if len(x) > 1 else x.new_zeros(())
    return ((x - x.mean()) / (std + eps)).to(rewards.dtype)


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, group: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++-baseline (arXiv 2501.03262): the group mean subtracted first, d_i = r_i - mean_g, then d whitened
    over the whole batch, (d - mean(d)) / (std(d) + eps), unbiased std. A constant group gets exactly 0. [N] -> [N]."""
    mean, _, _ = _group_stats(rewards, group)
    return reinforce_pp_advantages((rewards.double() - mean.double()).to(rewards.dtype), eps)


ADVANTAGES = ("grpo", "drgrpo", "rloo", "reinforce++", "reinforce++-baseline")


def scalar_advantages(name: str, rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Per-sample advantages [N] by estimator name (one of ADVANTAGES); `group` holds any integer ids [N]."""
    if name == "grpo":
        return grpo_advantages(rewards, group)
    if name == "drgrpo":
        return drgrpo_advantages(rewards, group)
    if name == "rloo":
        return rloo_advantages(rewards, group)
    if name == "reinforce++":
        return reinforce_pp_advantages(rewards)
    if name == "reinforce++-baseline":
        return reinforce_pp_baseline_advantages(rewards, group)
    raise ValueError(f"unknown advantage estimator {name!r}; expected one of {ADVANTAGES}")


def unit_advantages(name: str, rewards: torch.Tensor, group: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """scalar_advantages where the samples that share a `unit` id (the segments of one external agent's session, which
    share its one result) count once in the statistics, with their first sample's reward, and share its advantage.
    rewards, group, unit [N] -> [N]."""
    ids, index = torch.unique(unit, return_inverse=True)
    first = torch.full((len(ids),), len(unit), dtype=torch.long).scatter_reduce_(
        0, index, torch.arange(len(unit)), "amin")
    return scalar_advantages(name, rewards[first], group[first])[index]


def nonconstant_groups(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Bool [N]: True for samples whose group has unequal rewards (DAPO dynamic sampling keeps these)."""
    ids, index = torch.unique(group, return_inverse=True)
    n = len(ids)
    high = rewards.new_full((n,), -math.inf).scatter_reduce_(0, index, rewards, "amax")
    low = rewards.new_full((n,), math.inf).scatter_reduce_(0, index, rewards, "amin")
    return (high > low)[index]


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), added to the reward: 0 up to max_len - buffer
    tokens, then falling linearly to -factor at max_len, -factor beyond it. lengths [N] -> penalties [N]."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"the overlong buffer must be in (0, max_len = {max_len}], got {buffer}")
    over = (lengths.double() - (max_len - buffer)).clamp(min=0, max=buffer)
    return (-factor * over / buffer).to(torch.float32)


# ------------------------------------------------------------------------------------------------------- PPO: GAE


def outcome_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token rewards [B, T] holding each sample's score [B] on its last masked-in token, 0 elsewhere."""
    position = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask.bool(), position, -1).amax(dim=1)
    if (last < 0).any():
        raise ValueError(f"samples {(last < 0).nonzero().flatten().tolist()} have no masked-in token to reward")
    return torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device).scatter_(1, last[:, None], scores[:, None])


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al., arXiv 1506.02438) over the masked-in tokens only. [B, T] each.

    delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next, where "next" is the next masked-in token of
    the row (0 after the last one): a multi-turn mask [1,1,0,0,1] is the 3-token chain 0 -> 1 -> 4, the tool output in
    between is skipped, not a step. Returns (advantages, returns = advantages + values), both 0 where mask = 0.
    Rewards must sit on masked-in tokens (see outcome_token_rewards); a reward elsewhere is an error, not dropped."""
    on = mask.bool()
    if (torch.where(on, 0, rewards) != 0).any():
        raise ValueError("gae: nonzero reward on a masked-out token (prompt/tool output); put it on a policy token")
    next_value = values.new_zeros(values.shape[0])
    next_adv = values.new_zeros(values.shape[0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        adv = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv
        next_adv = torch.where(on[:, t], adv, next_adv)
        next_value = torch.where(on[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(on[:, t], adv, 0)
    return advantages, torch.where(on, advantages + values, 0)


# -------------------------------------------------------------------------------------------------- policy losses


MAX_LOG_RATIO = 20.0  # as verl: exp(20) is a finite ratio in fp32, exp(89) is inf (and inf * 0 a NaN gradient)
# verl's rejection options: a per-token statistic (k1 = log(engine / trainer), k2 = its square / 2, k3 = rho - 1 -
# log rho), judged per token or over each sequence (sum, mean, or max).
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _truncated_is_weight(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor | None, cap: float | None,
                         mask: torch.Tensor) -> torch.Tensor | None:
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL"):
    min(exp(old - engine), C), detached, corrects for the engine sampling from a slightly different distribution.

    With top-p/top-k < full vocabulary it does not: the engine's logprobs are those of the renormalised truncated
    distribution q = p / Z on the kept set, the trainer's are of the full p, so every weight is Z (< 1, the kept mass)
    times the numerical mismatch: tokens are down-weighted by how much mass the truncation cut, and tokens outside the
    kept set are never sampled, a bias no weight of sampled tokens can undo. Train with top_p = 1 and top_k = 0."""
    if cap is None:
        return None
    if engine_logprobs is None:
        raise ValueError("tis_cap is set but no engine_logprobs were given")
    return torch.where(mask.bool(), old_logprobs - engine_logprobs, 0).exp().clamp(max=cap).detach()


def is_threshold_bounds(spec: str | float) -> tuple[float | None, float]:
    """--rollout-is-threshold as (lower, upper): "C" truncates weights at C (TIS; lower None), "lo_hi" zeroes weights
    outside [lo, hi] (IcePop)."""
    text = str(spec).strip()
    lower, _, upper = text.rpartition("_")
    try:
        bounds = (float(lower) if lower else None, float(upper))
    except ValueError:
        raise ValueError(f"rollout IS threshold {spec!r}: expected a number C (truncate at C) or lo_hi (IcePop: "
                         "zero the weights outside [lo, hi])") from None
    if bounds[1] <= 0 or (bounds[0] is not None and not 0 < bounds[0] <= bounds[1]):
        raise ValueError(f"rollout IS threshold {spec!r}: need 0 < lo <= hi")
    return bounds


def rs_bounds(options: str, spec: str | float | None) -> dict[str, tuple[float | None, float]]:
    """--rollout-rs and --rollout-rs-threshold as {option: (lower, upper)}, one threshold for all options or one per
    option, in order. A k1 option takes ratio bounds "lo_hi" (a single u means [1/u, u]); k2 and k3 an upper bound."""
    names = [o.strip() for o in options.split(",") if o.strip()]
    unknown = [o for o in names if o not in RS_OPTIONS]
    if not names or unknown:
        raise ValueError(f"rollout rejection {options!r}: unknown option(s) {unknown}; expected comma-separated "
                         f"options of {', '.join(RS_OPTIONS)}")
    specs = [s.strip() for s in str(spec).split(",")] if spec is not None else []
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout rejection {options!r} needs one threshold, or one per option; got {spec!r}")
    bounds = {}
    for name, text in zip(names, specs * len(names) if len(specs) == 1 else specs):
        try:
            low, _, high = text.rpartition("_")
            high = float(high)
            low = (float(low) if low else 1 / high) if name.endswith("k1") else None
        except ValueError:
            raise ValueError(f"rollout rejection {name}: threshold {text!r} is not a number (or lo_hi for k1)") \
                from None
        if (low is None and "_" in text) or high <= 0 or (low is not None and not 0 < low <= high):
            raise ValueError(f"rollout rejection {name}: threshold {text!r}; k1 takes lo_hi with 0 < lo <= hi or one "
                             "ratio u > 0, k2 and k3 one upper bound > 0")
        bounds[name] = (low, high)
    return bounds


def _masked_extreme(x: torch.Tensor, on: torch.Tensor, largest: bool, dim: int | None = None) -> torch.Tensor:
    """Max (or min) of x where `on` (over `dim`, or everything); 0 where nothing is on."""
    x = torch.where(on, x, -math.inf if largest else math.inf)
    if x.numel() == 0:
        return x.new_zeros(() if dim is None else x.shape[:dim] + x.shape[dim:][1:])
    out = (x.amax() if largest else x.amin()) if dim is None else (x.amax(dim) if largest else x.amin(dim))
    return torch.where(torch.isinf(out), 0, out)


def rollout_correction(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                       is_level: str | None = None, is_threshold: str | float = 2.0, batch_normalize: bool = False,
                       rs: str | None = None, rs_threshold: str | float | None = None,
                       sum_over_ranks=None) -> tuple[torch.Tensor | None, torch.Tensor, dict]:
    """Importance weights and rejection for tokens the engine sampled from another policy (its numerics, or an older
    version of the weights: partial rollouts), as verl's rollout correction defines them (docs/algo/rollout_corr.md,
    `rollout_corr_helper`). All [B, T]; lr_t = old - engine on the mask, rho_t = exp(lr_t).

    Weights (is_level): "token": exp(clamp(lr_t, +-20)); "sequence": exp(clamp(S, +-20)) on every token of the row,
    S = sum_t lr_t of the raw log-ratios (one token at lr = -25 gives e^-25, not e^-20). is_threshold "C" truncates them
    at C (TIS); "lo_hi" zeroes those outside [lo, hi] (IcePop). batch_normalize divides them by their mean (over the
    tokens, or for "sequence" over the rows) unless it is <= 1e-8; `sum_over_ranks` (a function summing a tensor over
    the data-parallel ranks) makes that mean the global batch's. Weights are detached, 0 off the mask.

    Rejection (rs, comma-separated options, all must keep a token): with lr clamped to +-20, k1 = -lr (the log of
    engine over trainer: "lo_hi" bounds the inverse ratio), k2 = lr^2 / 2, k3 = rho - 1 - lr; token_kX judges each
    token, seq_sum_kX / seq_mean_kX / seq_max_kX each row by the sum / mean / max over its tokens and drop it whole.
    k1 keeps log lo <= stat <= log hi, k2 and k3 keep stat <= upper (rs_bounds).

    Returns (weights or None; the mask less what was rejected; verl's metrics, unprefixed: rollout_is_* (mean, max,
    min, std, eff_sample_size, ratio_fraction_high/low, seq_mean/std/max/min, oob_ratio with IcePop,
    batch_norm_factor), rollout_rs_<option>_{mean,max,min,masked_fraction,seq_masked_fraction}, rollout_rs_masked_
    fraction, rollout_rs_seq_masked_fraction, and the diagnostics kl, k3_kl (of KL(engine || trainer)), training_ppl,
    rollout_ppl, log_ppl_diff, ppl_ratio, chi2_token, chi2_seq)."""
    if is_level not in (None, "token", "sequence"):
        raise ValueError(f"rollout correction: is_level {is_level!r}; expected None, token or sequence")
    on = mask.bool()
    rows = on.any(-1)  # rows with a token to train (the others count in no row statistic)
    log_ratio = torch.where(on, old_logprobs - engine_logprobs, 0).detach().double()
    bounded = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    seq_sum = log_ratio.sum(-1)  # the raw sum, as verl
    stats = {}

    def row_mean(x: torch.Tensor) -> float:
        return x[rows].mean().item() if rows.any() else 0.0

    weights = None
    if is_level is not None:
        lower, upper = is_threshold_bounds(is_threshold)
        raw = bounded.exp() if is_level == "token" else seq_sum.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()[:, None]
        raw = torch.where(on, raw.expand_as(bounded), 0)
        weights = raw.clamp(max=upper) if lower is None else torch.where((raw >= lower) & (raw <= upper), raw, 0)
        low = lower if lower is not None else 1 / upper
        seq = masked_mean(weights, mask, dim=-1)
        stats |= {"rollout_is_mean": masked_mean(weights, mask).item(),
                  "rollout_is_std": masked_mean((weights - masked_mean(weights, mask)) ** 2, mask).sqrt().item(),
                  "rollout_is_seq_mean": row_mean(seq),
                  "rollout_is_seq_std": seq[rows].std().item() if rows.sum() > 1 else 0.0,
                  "rollout_is_seq_max": _masked_extreme(seq, rows, True).item(),
                  "rollout_is_seq_min": _masked_extreme(seq, rows, False).item()}
        if is_level == "token":
            stats |= {"rollout_is_max": _masked_extreme(weights, on, True).item(),
                      "rollout_is_min": _masked_extreme(weights, on, False).item(),
                      "rollout_is_ratio_fraction_high": masked_mean((raw > upper).double(), mask).item(),
                      "rollout_is_ratio_fraction_low": masked_mean((raw < low).double(), mask).item()}
        else:  # judged on the raw sums (verl #6806: past the clamp every sequence looks alike)
            stats |= {"rollout_is_max": _masked_extreme(seq_sum.clamp(max=MAX_LOG_RATIO), rows, True).exp().item(),
                      "rollout_is_min": _masked_extreme(seq_sum, rows, False).exp().item(),
                      "rollout_is_ratio_fraction_high": row_mean((seq_sum > math.log(upper)).double()),
                      "rollout_is_ratio_fraction_low": row_mean((seq_sum < math.log(low)).double())}
        normed = weights / masked_mean(weights, mask).clamp(min=1e-8)
        stats["rollout_is_eff_sample_size"] = 1 / masked_mean(normed ** 2, mask).clamp(min=1e-12).item()
        if lower is not None:
            stats["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).double(), mask).item()
        if batch_normalize:
            total, count = ((weights.sum(), on.sum()) if is_level == "token" else (seq[rows].sum(), rows.sum()))
            moments = torch.stack([total.double(), count.double()])
            moments = sum_over_ranks(moments) if sum_over_ranks is not None else moments
            factor = (moments[0] / moments[1].clamp(min=1)).item()
            stats["rollout_is_batch_norm_factor"] = factor if factor > 1e-8 else 1.0
            weights = weights / stats["rollout_is_batch_norm_factor"]
        weights = weights.to(old_logprobs.dtype)
    kept = on.clone()
    if rs is not None:
        statistic = {"k1": -bounded, "k2": 0.5 * bounded ** 2, "k3": bounded.exp() - 1 - bounded}
        for option, (low, high) in rs_bounds(rs, rs_threshold).items():
            level, _, estimator = option.rpartition("_")
            x = statistic[estimator]
            if level != "token":
                x = {"seq_sum": masked_sum(x, mask, dim=-1), "seq_mean": masked_mean(x, mask, dim=-1),
                     "seq_max": _masked_extreme(x, on, True, dim=-1)}[level][:, None].expand_as(x)
            keep = (x >= math.log(low)) & (x <= math.log(high)) if low is not None else x <= high
            kept &= keep
            stats |= {f"rollout_rs_{option}_mean": masked_mean(x, mask).item(),
                      f"rollout_rs_{option}_max": _masked_extreme(x, on, True).item(),
                      f"rollout_rs_{option}_min": _masked_extreme(x, on, False).item(),
                      f"rollout_rs_{option}_masked_fraction": masked_mean((~keep).double(), mask).item(),
                      f"rollout_rs_{option}_seq_masked_fraction": row_mean((on & ~keep).any(-1).double())}
        stats |= {"rollout_rs_masked_fraction": masked_mean((on & ~kept).double(), mask).item(),
                  "rollout_rs_seq_masked_fraction": row_mean((on & ~kept).any(-1).double())}
    train_mean = masked_mean(old_logprobs.detach().double(), mask, dim=-1)
    engine_mean = masked_mean(engine_logprobs.detach().double(), mask, dim=-1)
    stats |= {"kl": masked_mean(-log_ratio, mask).item(),  # k1 of KL(engine || trainer): E_engine[engine - old]
              "k3_kl": masked_mean(bounded.exp() - 1 - bounded, mask).item(),
              "training_ppl": row_mean((-train_mean).exp()), "rollout_ppl": row_mean((-engine_mean).exp()),
              "log_ppl_diff": row_mean(engine_mean - train_mean),
              "ppl_ratio": row_mean((engine_mean - train_mean).exp()),
              "chi2_token": masked_mean((2 * bounded).exp(), mask).item() - 1,
              "chi2_seq": row_mean((2 * seq_sum.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).exp()) - 1}
    return weights, kept.to(mask.dtype), stats


def _clipped_objective(ratio: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                       clip_low: float, clip_high: float, dual_clip: float | None,
                       tis_weight: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), dual-clipped for A < 0, times the TIS weight; plus stats."""
    advantages = torch.where(mask.bool(), advantages, 0)
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high))
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        dual = (advantages < 0) & (loss > -advantages * dual_clip)
        loss = torch.where(dual, -advantages * dual_clip, loss)
    if tis_weight is not None:
        loss = loss * tis_weight
    with torch.no_grad():
        r, lr = ratio.detach(), log_ratio.detach()
        stats = {
            "pg_clipfrac_low": masked_mean(((advantages < 0) & (r < 1 - clip_low)).float(), mask),
            "pg_clipfrac_high": masked_mean(((advantages > 0) & (r > 1 + clip_high)).float(), mask),
            "pg_clipfrac_dual": masked_mean(dual.float(), mask),
            "ppo_kl": masked_mean(lr.exp() - 1 - lr, mask),  # k3 of KL(old || new), >= 0
            "ratio_mean": masked_mean(r, mask),
        }
        if tis_weight is not None:
            stats["tis_weight_mean"] = masked_mean(tis_weight, mask)
    values = dict(zip(stats, torch.stack([v.float() for v in stats.values()]).tolist()))  # one device sync for all
    values["pg_clipfrac"] = values["pg_clipfrac_low"] + values["pg_clipfrac_high"]  # disjoint: A < 0 or A > 0
    return torch.where(mask.bool(), loss, 0), values


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                        dual_clip: float | None = None, engine_logprobs: torch.Tensor | None = None,
                        tis_cap: float | None = None) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate per token (arXiv 1707.06347), r = exp(logprobs - old_logprobs), all [B, T].

    Separate clip_low/clip_high is DAPO's clip-higher (arXiv 2503.14476, e.g. 0.2/0.28). dual_clip = c > 1 bounds the
    loss of A < 0 tokens at -c A when r is huge (arXiv 1912.09729). tis_cap = C multiplies by min(exp(old - engine), C).
    Returns (token loss [B, T], 0 off-mask; stats: pg_clipfrac (low + high), pg_clipfrac_low/high, pg_clipfrac_dual,
    ppo_kl, ratio_mean as floats, token means over this call's mask)."""
    log_ratio = torch.where(mask.bool(), (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), 0)
    return _clipped_objective(log_ratio.exp(), log_ratio, advantages, mask, clip_low, clip_high, dual_clip,
                              _truncated_is_weight(old_logprobs, engine_logprobs, tis_cap, mask))


def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float = 3e-4, clip_high: float = 4e-4, engine_logprobs: torch.Tensor | None = None,
              tis_cap: float | None = None) -> tuple[torch.Tensor, dict]:
    """GSPO-token (arXiv 2507.18071): sequence ratio s_i = exp(mean_t(logprobs - old_logprobs)), clipped per sequence.

    Token ratio s_it = sg(s_i) * p_t / sg(p_t): its value is s_i, its gradient flows through each token. The paper's
    objective is aggregate(..., "seq-mean-token-mean"); clip ranges are ~1e-4 (paper: 3e-4 / 4e-4). Same returns as
    clipped_policy_loss; clip fractions count tokens of clipped sequences."""
    on = mask.bool()
    log_ratio = torch.where(on, (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), 0)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)[:, None]
    token_log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()
    ratio = torch.where(on, token_log_ratio, 0).exp()
    return _clipped_objective(ratio, log_ratio, advantages, mask, clip_low, clip_high, None,
                              _truncated_is_weight(old_logprobs, engine_logprobs, tis_cap, mask))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = 0.2) -> tuple[torch.Tensor, float]:
    """PPO clipped value loss 0.5 max((V - R)^2, (clip(V, V_old +- clip) - R)^2) per token [B, T], 0 off-mask.

    Returns (token loss, clip fraction = share of masked tokens where the clipped term is the larger one)."""
    on = mask.bool()
    loss = torch.where(on, values - returns, 0) ** 2
    clipped_frac = values.new_zeros(())
    if clip is not None:
        clipped = torch.where(on, old_values + (values - old_values).clamp(-clip, clip) - returns, 0) ** 2
        clipped_frac = masked_mean((clipped > loss).float().detach(), mask)
        loss = torch.maximum(loss, clipped)
    return 0.5 * loss, clipped_frac.item()


# ------------------------------------------------------------------------------------------------------------------- KL


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3",
               clamp: float = 10.0) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from tokens sampled from the policy (Schulman, "Approximating KL").

    With d = ref - logprobs: k1 = -d (unbiased, can be negative), k2 = d^2 / 2, k3 = exp(d) - 1 - d (unbiased, >= 0,
    low variance; d clamped to +-20 and the result to <= clamp). Same shape as the inputs; add it to the loss or
    subtract coef * it from token rewards. Masking is left to the caller (aggregate / masked_sum)."""
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d ** 2
    if estimator == "k3":
        d = d.clamp(-20, 20)
        return (d.exp() - 1 - d).clamp(max=clamp)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")


# ------------------------------------------------------------------------------------ on-policy distillation


def distill_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                       coef: float = 1.0) -> torch.Tensor:
    """On-policy distillation's per-token advantage (Agarwal et al. 2024, arXiv 2306.13649; as slime's
    `apply_opd_kl_to_advantages`, verl's PG OPD and tinker-cookbook's `incorporate_kl_penalty`): on tokens the student
    sampled, A_t = -coef (log p_student(y_t) - log p_teacher(y_t)), the sampled reverse-KL term with the teacher held
    constant: tokens the teacher finds likelier than the student are pushed up. Added to the algorithm's own
    advantages (mixed with the task reward) or alone (distillation alone). [B, T] -> [B, T], 0 off the mask;
    detached."""
    return torch.where(mask.bool(), -coef * (student_logprobs - teacher_logprobs), 0).detach()


# ------------------------------------------------------------------------------------------------- aggregation

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", num_tokens: float | None = None,
              num_seqs: float | None = None, max_len: int | None = None) -> torch.Tensor:
    """Token losses [B, T] -> scalar, with verl's mode names (l = token loss, m = mask, i = sequence, t = token):

    token-mean               sum_it m l / N_tokens                  (DAPO; every token weighs the same)
    seq-mean-token-sum       sum_i (sum_t m l) / N_seqs
    seq-mean-token-mean      sum_i (sum_t m l / sum_t m) / N_seqs   (original GRPO, GSPO)
    seq-mean-token-sum-norm  sum_it m l / (N_seqs * max_len)        (Dr.GRPO; max_len a constant, e.g. max new tokens)

    Without normalisers, N_tokens / N_seqs are this call's counts (sequences = rows with a masked-in token; an
    all-masked row counts for nothing). Data parallel / gradient accumulation: pass the GLOBAL counts (summed over
    every micro-batch of every rank in the optimizer step); then the sum of the returned values over micro-batches and
    ranks equals the loss of the whole batch at once. DDP/FSDP average gradients over ranks, so multiply by the world
    size before backward. (verl's seq-mean-token-sum-norm divides the per-micro-batch sum by max_len only; ours
    also divides by N_seqs, as Dr.GRPO's own code does, so the scale does not grow with the batch.)"""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")
    if mode == "token-mean":
        return masked_sum(token_loss, mask) / (mask.sum().clamp(min=1) if num_tokens is None else max(num_tokens, 1))
    seq_sum = masked_sum(token_loss, mask, dim=-1)
    seqs = (mask.sum(-1) > 0).sum().clamp(min=1) if num_seqs is None else max(num_seqs, 1)
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / seqs
    if mode == "seq-mean-token-mean":
        return (seq_sum / mask.sum(-1).clamp(min=1)).sum() / seqs
    if max_len is None:
        raise ValueError("seq-mean-token-sum-norm needs max_len (a constant horizon, e.g. the max new tokens)")
    return seq_sum.sum() / (seqs * max_len)
