"""losses.py against values worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

import losses

INF = float("inf")
NAN = float("nan")


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------------- masked statistics

X = torch.tensor([[1.0, 2.0, INF], [NAN, 5.0, -INF]])  # garbage where the mask is 0
M = torch.tensor([[1, 1, 0], [0, 1, 0]])


def test_masked_sum_and_mean_ignore_masked_out_garbage():
    close(losses.masked_sum(X, M), 8.0)  # 1 + 2 + 5
    close(losses.masked_mean(X, M), 8 / 3)
    close(losses.masked_sum(X, M, dim=-1), [3.0, 5.0])
    close(losses.masked_mean(X, M, dim=-1), [1.5, 5.0])


def test_masked_mean_of_all_masked_row_is_zero():
    close(losses.masked_mean(X, torch.tensor([[1, 0, 0], [0, 0, 0]]), dim=-1), [1.0, 0.0])
    close(losses.masked_mean(X, torch.zeros_like(M)), 0.0)


# ---------------------------------------------------------------------------------------------- per-sample advantages

# group 7: rewards 1, 0, 0, 1 (mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.5773503); group 3: 0.5, 0.5 (zero
# variance); group 9: a single sample. Ids need not be contiguous or sorted.
REWARDS = torch.tensor([1.0, 0.5, 0.0, 2.0, 0.0, 0.5, 1.0])
GROUPS = torch.tensor([7, 3, 7, 9, 7, 3, 7])


def test_grpo_std_normalised():
    a = 0.5 / (0.5773503 + 1e-6)  # = 0.8660239
    close(losses.grpo_advantages(REWARDS, GROUPS), [a, 0.0, -a, 0.0, -a, 0.0, a])


def test_grpo_zero_variance_and_single_sample_groups_are_zero_and_finite():
    adv = losses.grpo_advantages(torch.tensor([0.1, 0.1, 0.1, 3.0]), torch.tensor([0, 0, 0, 1]))
    assert torch.isfinite(adv).all()
    close(adv, [0.0, 0.0, 0.0, 0.0], atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce++", "reinforce++-baseline"])
def test_constant_rewards_give_exactly_zero_advantage(name):
    # In float32, mean(7 x 0.7) - 0.7 is ~1e-8 and so is the std: their ratio would be 0.056 of pure noise.
    rewards = torch.full((7,), 0.7)
    assert losses.scalar_advantages(name, rewards, torch.zeros(7, dtype=torch.long)).abs().max().item() == 0.0


def test_drgrpo_has_no_std_division():
    close(losses.drgrpo_advantages(REWARDS, GROUPS), [0.5, 0.0, -0.5, 0.0, -0.5, 0.0, 0.5])
    close(losses.scalar_advantages("drgrpo", REWARDS * 10, GROUPS), [5.0, 0.0, -5.0, 0.0, -5.0, 0.0, 5.0])


def test_rloo_leave_one_out_baseline():
    # group 7: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3. group 5: 3 - mean(1, 2) = 1.5, 1 - 2.5 = -1.5,
    # 2 - 2 = 0. group 3 (0.5, 0.5): 0. group 9 (one sample, no baseline): 0.
    rewards = torch.cat([REWARDS, torch.tensor([3.0, 1.0, 2.0])])
    groups = torch.cat([GROUPS, torch.tensor([5, 5, 5])])
    close(losses.rloo_advantages(rewards, groups), [2 / 3, 0.0, -2 / 3, 0.0, -2 / 3, 0.0, 2 / 3, 1.5, -1.5, 0.0])


def test_reinforce_pp_batch_normalised():
    # 1, 2, 3, 6: mean 3, deviations -2, -1, 0, 3, squares sum 14, unbiased var 14/3, std 2.1602469
    close(losses.reinforce_pp_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0])),
          [-0.9258201, -0.4629100, 0.0, 1.3887301])


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens_the_batch():
    # groups 0: 1, 0 (mean 0.5) and 1: 3, 1 (mean 2) -> d = 0.5, -0.5, 1, -1; mean(d) = 0,
    # unbiased std(d) = sqrt((0.25 + 0.25 + 1 + 1) / 3) = 0.9128709 -> d / (0.9128709 + 1e-6)
    a, b = 0.5 / (0.9128709 + 1e-6), 1 / (0.9128709 + 1e-6)  # 0.5477220, 1.0954439
    rewards, group = torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 1, 1])
    close(losses.scalar_advantages("reinforce++-baseline", rewards, group), [a, -a, b, -b])
    # A constant group adds d = 0, 0: still 0 after whitening (mean(d) stays 0); std = sqrt(2.5 / 5) = 0.7071068.
    a, b = 0.5 / (0.7071068 + 1e-6), 1 / (0.7071068 + 1e-6)
    close(losses.scalar_advantages("reinforce++-baseline", torch.tensor([1.0, 0.0, 3.0, 1.0, 0.4, 0.4]),
                                   torch.tensor([0, 0, 1, 1, 2, 2])), [a, -a, b, -b, 0.0, 0.0])


def test_dapo_soft_overlong_penalty():
    # max_len 10, buffer 4: free up to 6 tokens, then -(length - 6) / 4 * factor, -factor at 10 and beyond
    lengths = torch.tensor([0, 5, 6, 7, 9, 10, 12])
    close(losses.overlong_penalty(lengths, 10, 4, factor=0.5), [0.0, 0.0, 0.0, -0.125, -0.375, -0.5, -0.5])
    close(losses.overlong_penalty(lengths, 10, 10), [0.0, -0.5, -0.6, -0.7, -0.9, -1.0, -1.0])
    for buffer in (0, 11):
        with pytest.raises(ValueError, match="overlong buffer must be in"):
            losses.overlong_penalty(lengths, 10, buffer)


def test_scalar_advantages_dispatch():
    close(losses.scalar_advantages("grpo", REWARDS, GROUPS)[0], 0.8660239)
    close(losses.scalar_advantages("rloo", REWARDS, GROUPS)[0], 2 / 3)
    close(losses.scalar_advantages("reinforce++", torch.tensor([0.0, 2.0]), torch.tensor([0, 0])),
          [-0.7071064, 0.7071064])  # mean 1, unbiased std sqrt(2)
    with pytest.raises(ValueError, match="ppo"):
        losses.scalar_advantages("ppo", REWARDS, GROUPS)


def test_nonconstant_groups():
    # 0.1 three times is constant (an exact max == min test, not a float std that may come out 1e-17)
    keep = losses.nonconstant_groups(torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 5.0]), torch.tensor([4, 4, 4, 2, 2, 8]))
    assert keep.tolist() == [False, False, False, True, True, False]


# ------------------------------------------------------------------------------------------------------------- GAE


def test_outcome_token_rewards_on_last_policy_token():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]])
    close(losses.outcome_token_rewards(torch.tensor([1.0, 0.5]), mask), [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.0]])
    with pytest.raises(ValueError, match=r"samples \[1\]"):
        losses.outcome_token_rewards(torch.tensor([1.0, 0.5]), torch.tensor([[1, 0], [0, 0]]))


def test_gae_undiscounted_is_return_minus_value():
    # gamma = lam = 1: A_t = sum of future rewards - V_t = 1 - V_t
    adv, ret = losses.gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.2, 0.4]]), torch.ones(1, 3))
    close(adv, [[0.5, 0.8, 0.6]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_multi_turn_holes_are_skipped():
    # Row 0, mask [1,1,0,0,1] = chain of tokens 0 -> 1 -> 4 (tool output at 2, 3 has garbage values 100, -100).
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72):
    #   t4: delta = 1 + 0.9*0 - 3 = -2;               A = -2
    #   t1: delta = 0.5 + 0.9*3 - 2 = 1.2;            A = 1.2 + 0.72*(-2) = -0.24
    #   t0: delta = 0 + 0.9*2 - 1 = 0.8;              A = 0.8 + 0.72*(-0.24) = 0.6272
    # Row 1, mask [0,1,1,0,0] (prompt then padding):
    #   t2: delta = 2 - 1 = 1;                        A = 1
    #   t1: delta = 0 + 0.9*1 - 0.5 = 0.4;            A = 0.4 + 0.72*1 = 1.12
    rewards = torch.tensor([[0.0, 0.5, 0.0, 0.0, 1.0], [0.0, 0.0, 2.0, 0.0, 0.0]])
    values = torch.tensor([[1.0, 2.0, 100.0, -100.0, 3.0], [9.0, 0.5, 1.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 0, 0]])
    adv, ret = losses.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.6272, -0.24, 0.0, 0.0, -2.0], [0.0, 1.12, 1.0, 0.0, 0.0]])
    close(ret, [[1.6272, 1.76, 0.0, 0.0, 1.0], [0.0, 1.62, 2.0, 0.0, 0.0]])
    # the same as the dense 3-token chain
    chain_adv, _ = losses.gae(torch.tensor([[0.0, 0.5, 1.0]]), torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3),
                              gamma=0.9, lam=0.8)
    close(chain_adv, [[0.6272, -0.24, -2.0]])


def test_gae_rejects_reward_on_masked_out_token():
    with pytest.raises(ValueError, match="masked-out"):
        losses.gae(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.tensor([[1, 0]]))


# ------------------------------------------------------------------------------------------------- policy losses


def ratio_inputs(ratios):
    """logprobs requiring grad with old = 0, so the ratio of token t is ratios[t]."""
    logprobs = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    return logprobs, torch.zeros(1, len(ratios))


#       token:   a     b     c     d     e     f     g    (h: masked, -inf logprob, NaN advantage)
RATIOS = [1.5, 0.5, 0.5, 1.2, 5.0, 5.0, 2.5, 1.0]
ADVS = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0, -1.0, NAN]])
MASK8 = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])


def test_clipped_loss_values_gradients_and_stats():
    # clip_low 0.2 (ratio >= 0.8), clip_high 0.28 (ratio <= 1.28); loss = max(-A r, -A clip(r)):
    #   a A=+1 r=1.5: max(-1.5, -1.28) = -1.28 (clipped high, grad 0)
    #   b A=+1 r=0.5: max(-0.5, -0.8)  = -0.5  (pessimistic side, grad -A r = -0.5)
    #   c A=-1 r=0.5: max(0.5, 0.8)    = 0.8   (clipped low, grad 0)
    #   d A=-1 r=1.2: 1.2                      (inside, grad 1.2)
    #   e A=-1 r=5:   max(5, 1.28)     = 5     (grad 5; no dual clip)
    #   f A=+1 r=5:   max(-5, -1.28)   = -1.28 (clipped high, grad 0)
    #   g A=-1 r=2.5: 2.5                      (grad 2.5)
    logprobs, old = ratio_inputs(RATIOS)
    old[0, 7] = -INF
    logprobs.data[0, 7] = -INF
    loss, stats = losses.clipped_policy_loss(logprobs, old, ADVS, MASK8, clip_low=0.2, clip_high=0.28)
    close(loss, [[-1.28, -0.5, 0.8, 1.2, 5.0, -1.28, 2.5, 0.0]])
    loss.sum().backward()
    close(logprobs.grad, [[0.0, -0.5, 0.0, 1.2, 5.0, 0.0, 2.5, 0.0]])
    assert stats["pg_clipfrac_high"] == pytest.approx(2 / 7)  # a, f
    assert stats["pg_clipfrac_low"] == pytest.approx(1 / 7)  # c
    assert stats["pg_clipfrac_dual"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(16.2 / 7)  # 1.5+0.5+0.5+1.2+5+5+2.5
    # k3 = r - 1 - ln r: a 0.0945349, b 0.1931472, c 0.1931472, d 0.0176784, e 2.3905621, f 2.3905621, g 0.5837093
    assert stats["ppo_kl"] == pytest.approx(5.8633412 / 7, abs=1e-6)


def test_dual_clip_engages_only_for_negative_advantages():
    # c = 3: e (A=-1, r=5) is capped at -A c = 3 with grad 0; f (A=+1, r=5) is unchanged; g (A=-1, r=2.5 < 3) too.
    logprobs, old = ratio_inputs(RATIOS)
    loss, stats = losses.clipped_policy_loss(logprobs, old, ADVS, MASK8, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    close(loss, [[-1.28, -0.5, 0.8, 1.2, 3.0, -1.28, 2.5, 0.0]])
    loss.sum().backward()
    close(logprobs.grad, [[0.0, -0.5, 0.0, 1.2, 0.0, 0.0, 2.5, 0.0]])
    assert stats["pg_clipfrac_dual"] == pytest.approx(1 / 7)
    with pytest.raises(ValueError, match="dual_clip"):
        losses.clipped_policy_loss(logprobs, old, ADVS, MASK8, dual_clip=0.9)


def test_clip_higher_is_asymmetric():
    # A=+1 r=1.25 and A=-1 r=0.75. Symmetric 0.2: -1.2 (clipped) and 0.8 (clipped).
    # clip_high 0.28: the positive token is free (-1.25, grad -1.25); the low side still clips at 0.8.
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    logprobs, old = ratio_inputs([1.25, 0.75])
    loss, _ = losses.clipped_policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    close(loss, [[-1.2, 0.8]])
    loss, stats = losses.clipped_policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss, [[-1.25, 0.8]])
    loss.sum().backward()
    close(logprobs.grad, [[-1.25, 0.0]])
    assert (stats["pg_clipfrac_low"], stats["pg_clipfrac_high"]) == (0.5, 0.0)


def test_truncated_importance_sampling_caps_and_is_detached():
    # exp(old - engine) = exp(0), exp(1), exp(ln 2) = 1, 2.718, 2 -> capped at 2: 1, 2, 2. ratio 1, A = 1.
    logprobs, old = ratio_inputs([1.0, 1.0, 1.0, 1.0])
    engine = torch.tensor([[0.0, -1.0, -math.log(2.0), -INF]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = losses.clipped_policy_loss(logprobs, old, torch.ones(1, 4), mask, engine_logprobs=engine, tis_cap=2.0)
    close(loss, [[-1.0, -2.0, -2.0, 0.0]])
    loss.sum().backward()
    close(logprobs.grad, [[-1.0, -2.0, -2.0, 0.0]])  # -A r w
    assert engine.grad is None
    assert stats["tis_weight_mean"] == pytest.approx(5 / 3)
    with pytest.raises(ValueError, match="engine_logprobs"):
        losses.clipped_policy_loss(logprobs, old, torch.ones(1, 4), mask, tis_cap=2.0)


def test_gspo_equals_token_clip_when_all_tokens_share_a_ratio():
    # row 0: every token has ratio 1.5 (A=+1); row 1: ratio 0.5 on its 2 tokens (A=-1), then a masked -inf token
    lp_values = [[math.log(1.5)] * 3, [math.log(0.5)] * 2 + [-INF]]
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, -INF]])
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = []
    for fn in (losses.gspo_loss, losses.clipped_policy_loss):
        logprobs = torch.tensor(lp_values, requires_grad=True)
        loss, stats = fn(logprobs, old, adv, mask, clip_low=0.6, clip_high=0.6)  # nothing clipped
        loss.sum().backward()
        out.append((loss.detach(), logprobs.grad, stats))
    close(out[0][0], [[-1.5, -1.5, -1.5], [0.5, 0.5, 0.0]])
    close(out[0][0], out[1][0])
    close(out[0][1], [[-1.5, -1.5, -1.5], [0.5, 0.5, 0.0]])  # -A s per token
    close(out[0][1], out[1][1])
    assert out[0][2] == pytest.approx(out[1][2])


def test_gspo_clips_the_sequence_ratio():
    # row 0: log ratios ln 2, 0 -> s = exp(ln 2 / 2) = 1.4142136, A = +1; row 1: ln 0.25, 0 -> s = 0.5, A = -1.
    # Wide clip [0.4, 1.5]: nothing clipped; loss -A s per token: -1.4142136 and 0.5, and so is the grad per token.
    # Paper clip [1 - 3e-4, 1 + 4e-4]: row 0 max(-1.414, -1.0004) = -1.0004, row 1 max(0.5, 0.9997) = 0.9997, grad 0.
    lp_values = [[math.log(2.0), 0.0], [math.log(0.25), 0.0]]
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    old, mask = torch.zeros(2, 2), torch.ones(2, 2)
    logprobs = torch.tensor(lp_values, requires_grad=True)
    loss, stats = losses.gspo_loss(logprobs, old, adv, mask, clip_low=0.6, clip_high=0.5)
    close(loss, [[-1.4142136, -1.4142136], [0.5, 0.5]])
    loss.sum().backward()
    close(logprobs.grad, [[-1.4142136, -1.4142136], [0.5, 0.5]])
    assert stats["ratio_mean"] == pytest.approx((1.4142136 * 2 + 0.5 * 2) / 4)

    logprobs = torch.tensor(lp_values, requires_grad=True)
    loss, stats = losses.gspo_loss(logprobs, old, adv, mask)
    close(loss, [[-1.0004, -1.0004], [0.9997, 0.9997]])
    loss.sum().backward()
    close(logprobs.grad, torch.zeros(2, 2))
    assert (stats["pg_clipfrac_high"], stats["pg_clipfrac_low"]) == (0.5, 0.5)


def test_policy_loss_is_finite_with_garbage_off_mask():
    logprobs = torch.tensor([[-1.0, -INF, NAN]], requires_grad=True)
    old = torch.tensor([[-1.0, -INF, 3.0]])
    engine = torch.tensor([[-1.0, NAN, -INF]])  # TIS weight exp(0) = 1 on the one real token
    mask = torch.tensor([[1, 0, 0]])
    for fn in (losses.clipped_policy_loss, losses.gspo_loss):
        logprobs.grad = None
        loss, stats = fn(logprobs, old, torch.tensor([[1.0, NAN, INF]]), mask, engine_logprobs=engine, tis_cap=2.0)
        losses.aggregate(loss, mask).backward()
        close(loss, [[-1.0, 0.0, 0.0]])
        close(logprobs.grad, [[-1.0, 0.0, 0.0]])
        assert all(math.isfinite(v) for v in stats.values())


def test_value_loss_clipping():
    # clip 0.5, loss = 0.5 max((V - R)^2, (V_old + clamp(V - V_old, +-0.5) - R)^2):
    #   V=1 old=1 R=2: both (−1)^2 = 1 -> 0.5, grad V - R = -1, not clipped
    #   V=2 old=1 R=0: 4 vs (1.5)^2 = 2.25 -> 2.0, grad 2, not clipped (unclipped term is larger)
    #   V=2 old=1 R=3: 1 vs (−1.5)^2 = 2.25 -> 1.125, grad 0, clipped
    #   masked (V=5, old=NaN)
    values = torch.tensor([[1.0, 2.0, 2.0, 5.0]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 1.0, NAN]])
    returns = torch.tensor([[2.0, 0.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clip_frac = losses.value_loss(values, old, returns, mask, clip=0.5)
    close(loss, [[0.5, 2.0, 1.125, 0.0]])
    loss.sum().backward()
    close(values.grad, [[-1.0, 2.0, 0.0, 0.0]])
    assert clip_frac == pytest.approx(1 / 3)
    loss, clip_frac = losses.value_loss(values, old, returns, mask, clip=None)
    close(loss, [[0.5, 2.0, 0.5, 0.0]])
    assert clip_frac == 0.0


# ------------------------------------------------------------------------------------------------------------------- KL


def test_kl_estimators():
    # d = ref - logprob = -1, 1, 0
    logprobs, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-2.0, -1.0, -0.5])
    close(losses.kl_penalty(logprobs, ref, "k1"), [1.0, -1.0, 0.0])
    close(losses.kl_penalty(logprobs, ref, "k2"), [0.5, 0.5, 0.0])
    close(losses.kl_penalty(logprobs, ref, "k3"), [0.3678794, 0.7182818, 0.0])  # e^-1 - 1 + 1, e - 1 - 1, 0
    with pytest.raises(ValueError, match="k4"):
        losses.kl_penalty(logprobs, ref, "k4")


def test_k3_is_clamped_and_non_negative():
    # d = 30 -> clamped to 20, e^20 - 21 -> 10; d = -30 -> -20: e^-20 - 1 + 20 = 19.0000 -> 10; d = 0.5: 0.1487213
    k3 = losses.kl_penalty(torch.tensor([0.0, 0.0, 0.0]), torch.tensor([30.0, -30.0, 0.5]), "k3")
    close(k3, [10.0, 10.0, 0.1487213])
    assert (losses.kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0).all()


# ------------------------------------------------------------------------------------------------- aggregation

LOSS = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN], [NAN, NAN, NAN, NAN]])
LOSS_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # third row all masked: not a sequence


def test_aggregation_modes():
    close(losses.aggregate(LOSS, LOSS_MASK, "token-mean"), 2.5)  # (1+2+3+4) / 4
    close(losses.aggregate(LOSS, LOSS_MASK, "seq-mean-token-sum"), 5.0)  # (6 + 4) / 2
    close(losses.aggregate(LOSS, LOSS_MASK, "seq-mean-token-mean"), 3.0)  # (2 + 4) / 2
    close(losses.aggregate(LOSS, LOSS_MASK, "seq-mean-token-sum-norm", max_len=8), 0.625)  # 10 / (2 * 8)
    with pytest.raises(ValueError, match="max_len"):
        losses.aggregate(LOSS, LOSS_MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="token-sum"):
        losses.aggregate(LOSS, LOSS_MASK, "token-sum")


def test_aggregation_with_global_normalisers():
    close(losses.aggregate(LOSS, LOSS_MASK, "token-mean", num_tokens=8), 1.25)  # 10 / 8
    close(losses.aggregate(LOSS, LOSS_MASK, "seq-mean-token-sum", num_seqs=4), 2.5)  # 10 / 4
    close(losses.aggregate(LOSS, LOSS_MASK, "seq-mean-token-mean", num_seqs=4), 1.5)  # 6 / 4
    close(losses.aggregate(LOSS, LOSS_MASK, "seq-mean-token-sum-norm", num_seqs=4, max_len=5), 0.5)  # 10 / 20
    close(losses.aggregate(LOSS, torch.zeros_like(LOSS_MASK), "token-mean", num_tokens=0), 0.0)


def test_micro_batch_sums_add_up_to_the_global_token_mean():
    # Global batch: rank 0 holds [1, 2, 3], rank 1 holds [5] (4 tokens, 2 sequences).
    # token-mean = 11 / 4 = 2.75; the naive mean of per-rank means would be (2 + 5) / 2 = 3.5.
    # seq-mean-token-mean = (2 + 5) / 2 = 3.5.
    rank0 = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    rank1 = torch.tensor([[5.0, NAN, NAN]], requires_grad=True)
    m0, m1 = torch.tensor([[1, 1, 1]]), torch.tensor([[1, 0, 0]])
    total = losses.aggregate(rank0, m0, num_tokens=4) + losses.aggregate(rank1, m1, num_tokens=4)
    close(total, 2.75)
    total.backward()
    close(rank0.grad, [[0.25, 0.25, 0.25]])  # every token weighs 1 / 4, wherever it sits
    close(rank1.grad, [[0.25, 0.0, 0.0]])
    total = (losses.aggregate(rank0, m0, "seq-mean-token-mean", num_seqs=2)
             + losses.aggregate(rank1, m1, "seq-mean-token-mean", num_seqs=2))
    close(total, 3.5)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_log_ratio_is_clamped_so_a_huge_ratio_stays_finite(dual_clip):
    """log r = 100 (an fp32 exp overflows past ~88): clamped to 20 as verl does, the loss is finite and so are the
    gradients. A = -1, clip 0.2: loss = max(e^20, 1.2) = e^20 (or, dual-clipped, 3), grad 0 (the clamp is flat there);
    the other token, log r = 0 and A = -1, has loss 1 and grad r = 1."""
    for fn in (losses.clipped_policy_loss, losses.gspo_loss):
        logprobs = torch.tensor([[0.0, -1.0]], requires_grad=True)
        old = torch.tensor([[-100.0, -1.0]])
        mask = torch.tensor([[1, 0]]) if fn is losses.gspo_loss else torch.tensor([[1, 1]])
        kwargs = {"dual_clip": dual_clip} if fn is losses.clipped_policy_loss else {"clip_low": 0.2, "clip_high": 0.2}
        if fn is losses.gspo_loss and dual_clip is not None:
            continue  # GSPO has no dual clip (train_grpo refuses the combination)
        loss, stats = fn(logprobs, old, torch.tensor([[-1.0, -1.0]]), mask, **kwargs)
        first = 3.0 if dual_clip else math.exp(20)
        close(loss.double(), [[first, 1.0 if fn is losses.clipped_policy_loss else 0.0]], atol=first * 1e-6)
        loss.sum().backward()
        assert torch.isfinite(logprobs.grad).all() and math.isfinite(stats["ppo_kl"]), (fn, logprobs.grad, stats)


# Two sequences, rho = exp(old - engine): [2, 1, 1/4] (log-ratio sum ln 1/2) and [1/2, 1/2] (sum ln 1/4), then a row
# with no token to train; the padding holds a ratio of e^100 that nothing may see.
LN = math.log
RC_OLD = torch.tensor([[LN(2), 0.0, LN(0.25), 100.0], [LN(0.5), LN(0.5), 100.0, 100.0], [100.0] * 4])
RC_ENGINE = torch.zeros(3, 4)
RC_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


def rc(**kwargs):
    return losses.rollout_correction(RC_OLD, RC_ENGINE, RC_MASK, **kwargs)


def test_rollout_correction_weights_by_hand():
    """Truncated (TIS) and two-sided (IcePop) weights per token and per sequence, batch-normalised, with verl's
    metrics."""
    token, kept, stats = rc(is_level="token", is_threshold=1.5)
    close(token, [[1.5, 1, 0.25, 0], [0.5, 0.5, 0, 0], [0] * 4])
    assert kept.tolist() == RC_MASK.tolist() and not any(k.startswith("rollout_rs") for k in stats)
    assert stats["rollout_is_mean"] == pytest.approx(0.75) and stats["rollout_is_max"] == pytest.approx(1.5)
    assert stats["rollout_is_min"] == pytest.approx(0.25) and stats["rollout_is_std"] == pytest.approx(math.sqrt(
        sum((w - 0.75) ** 2 for w in (1.5, 1, 0.25, 0.5, 0.5)) / 5))
    assert stats["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # 2 > 1.5
    assert stats["rollout_is_ratio_fraction_low"] == pytest.approx(3 / 5)  # 1/4, 1/2, 1/2 < 1/1.5
    assert stats["rollout_is_eff_sample_size"] == pytest.approx(45 / 61)  # 1 / mean((w / 0.75)^2)
    assert stats["rollout_is_seq_mean"] == pytest.approx((2.75 / 3 + 0.5) / 2)  # the empty row counts in no mean
    assert stats["kl"] == pytest.approx(3 * LN(2) / 5)  # mean of engine - old
    assert stats["k3_kl"] == pytest.approx(((2 - 1 - LN(2)) + (0.25 - 1 + LN(4)) + 2 * (0.5 - 1 + LN(2))) / 5)
    assert stats["chi2_token"] == pytest.approx((4 + 1 + 1 / 16 + 1 / 4 + 1 / 4) / 5 - 1)
    assert stats["chi2_seq"] == pytest.approx((1 / 4 + 1 / 16) / 2 - 1)
    assert stats["training_ppl"] == pytest.approx((2 ** (1 / 3) + 2) / 2) and stats["rollout_ppl"] == 1
    assert stats["log_ppl_diff"] == pytest.approx(2 / 3 * LN(2))  # mean over rows of mean(engine) - mean(old)
    assert stats["ppl_ratio"] == pytest.approx((2 ** (1 / 3) + 2) / 2)
    sequence, _, stats = rc(is_level="sequence", is_threshold=3.0)  # judged against [1/3, 3]
    close(sequence, [[0.5, 0.5, 0.5, 0], [0.25, 0.25, 0, 0], [0] * 4])
    assert (stats["rollout_is_max"], stats["rollout_is_min"]) == (pytest.approx(0.5), pytest.approx(0.25))
    assert stats["rollout_is_ratio_fraction_high"] == 0 and stats["rollout_is_ratio_fraction_low"] == 0.5
    capped, _, _ = losses.rollout_correction(-RC_OLD, RC_ENGINE, RC_MASK, "sequence", 3.0)  # products 2 and 4
    close(capped, [[2, 2, 2, 0], [3, 3, 0, 0], [0] * 4])
    # IcePop: weights outside [lo, hi] are zeroed, the mask is untouched
    icepop, kept, stats = rc(is_level="token", is_threshold="0.4_1.5")
    close(icepop, [[0, 1, 0, 0], [0.5, 0.5, 0, 0], [0] * 4])
    assert kept.tolist() == RC_MASK.tolist() and stats["rollout_is_oob_ratio"] == pytest.approx(2 / 5)
    icepop, _, _ = rc(is_level="sequence", is_threshold="0.3_2")
    close(icepop, [[0.5, 0.5, 0.5, 0], [0] * 4, [0] * 4])
    # batch normalisation: by the token mean 0.75; per sequence by the mean of the rows' weights, (0.5 + 0.25) / 2;
    # over ranks by the global mean (another rank holding 5 tokens of weight 1.25 in all: 5 / 10)
    normed, _, stats = rc(is_level="token", is_threshold=1.5, batch_normalize=True)
    close(normed, [[2, 4 / 3, 1 / 3, 0], [2 / 3, 2 / 3, 0, 0], [0] * 4])
    assert stats["rollout_is_batch_norm_factor"] == pytest.approx(0.75)
    normed, _, _ = rc(is_level="sequence", is_threshold=2.0, batch_normalize=True)
    close(normed, [[4 / 3] * 3 + [0], [2 / 3] * 2 + [0, 0], [0] * 4])
    normed, _, _ = rc(is_level="token", is_threshold=1.5, batch_normalize=True,
                      sum_over_ranks=lambda x: x + torch.tensor([1.25, 5.0], dtype=x.dtype))
    close(normed, [[3, 2, 0.5, 0], [1, 1, 0, 0], [0] * 4])
    with pytest.raises(ValueError, match="is_level 'seq'"):
        rc(is_level="seq")
    for bad in ("2_1", "x", "0"):
        with pytest.raises(ValueError, match="rollout IS threshold"):
            rc(is_level="token", is_threshold=bad)


def test_sequence_weights_from_the_raw_sum_as_verl():
    """A row with log-ratios -25 and +20: verl sums the raw log-ratios (-5) and then bounds the sum, e^-5; bounding each
    token first (-20 + 20 = 0) would give 1. Rejection bounds each token's log-ratio to +-20 (k1 = 25 -> 20)."""
    old, engine, mask = torch.tensor([[-25.0, 20.0]]), torch.zeros(1, 2), torch.ones(1, 2)
    weights, _, _ = losses.rollout_correction(old, engine, mask, "sequence", 2.0)
    close(weights, [[math.exp(-5)] * 2])
    _, kept, stats = losses.rollout_correction(old, engine, mask, rs="token_k1", rs_threshold="1e-9_1e9")
    assert kept.tolist() == [[1, 1]] and stats["rollout_rs_token_k1_max"] == pytest.approx(20)  # ln 1e9 = 20.7


@pytest.mark.parametrize("option, threshold, kept", [
    ("token_k1", "3", [[1, 1, 0, 0], [1, 1, 0, 0]]),  # k1 = ln 4 of the 1/4 token leaves [ln 1/3, ln 3]
    # k1 is log(engine / trainer): "0.6_3" bounds the inverse ratio, so rho = 2 (k1 = ln 1/2 < ln 0.6) goes too
    ("token_k1", "0.6_3", [[0, 1, 0, 0], [1, 1, 0, 0]]),
    ("seq_sum_k1", "3", [[1, 1, 1, 0], [0, 0, 0, 0]]),  # sums ln 2 and ln 4
    ("seq_mean_k1", "1.5", [[1, 1, 1, 0], [0, 0, 0, 0]]),  # geometric: means ln 2 / 3 and ln 2
    ("seq_mean_k1", "0.4_2.5", [[1, 1, 1, 0], [1, 1, 0, 0]]),
    ("token_k2", "0.5", [[1, 1, 0, 0], [1, 1, 0, 0]]),  # k2 = (ln 2)^2 / 2 = 0.24, 0, (ln 4)^2 / 2 = 0.96
    ("token_k3", "0.3", [[0, 1, 0, 0], [1, 1, 0, 0]]),  # k3 = 0.307, 0, 0.636; 0.193 twice
    ("seq_sum_k2", "0.5", [[0, 0, 0, 0], [1, 1, 0, 0]]),  # sums 1.20 and 0.48
    ("seq_mean_k3", "0.2", [[0, 0, 0, 0], [1, 1, 0, 0]]),  # means 0.314 and 0.193
    ("seq_max_k2", "0.5", [[0, 0, 0, 0], [1, 1, 0, 0]]),  # maxima 0.96 and 0.24
    ("seq_max_k3", "0.25", [[0, 0, 0, 0], [1, 1, 0, 0]]),  # maxima 0.636 and 0.193
])
def test_rollout_rejection_by_hand(option, threshold, kept):
    weights, mask, stats = rc(rs=option, rs_threshold=threshold)
    assert weights is None and mask.tolist() == [row + [] for row in kept] + [[0] * 4]
    rejected = 5 - sum(map(sum, kept))
    assert stats[f"rollout_rs_{option}_masked_fraction"] == pytest.approx(rejected / 5)
    assert stats["rollout_rs_masked_fraction"] == pytest.approx(rejected / 5)
    assert stats["rollout_rs_seq_masked_fraction"] == pytest.approx(
        sum(k != m for k, m in zip(kept, [[1, 1, 1, 0], [1, 1, 0, 0]])) / 2)


def test_rollout_rejection_options_combine():
    """Options are ANDed, with one threshold each (or one for all); bad options and thresholds are refused."""
    _, kept, stats = rc(rs="token_k1,seq_max_k2", rs_threshold="3,0.5")
    assert kept.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0], [0] * 4]
    assert stats["rollout_rs_token_k1_masked_fraction"] == pytest.approx(1 / 5)
    assert stats["rollout_rs_seq_max_k2_masked_fraction"] == pytest.approx(3 / 5)
    assert stats["rollout_rs_masked_fraction"] == pytest.approx(3 / 5) and stats[
        "rollout_rs_seq_masked_fraction"] == 0.5
    _, kept, _ = rc(rs="token_k2,token_k3", rs_threshold="0.5")  # both reject the 1/4 token only
    assert kept.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0] * 4]
    _, kept, _ = rc(rs="token_k2,token_k3", rs_threshold="0.5,0.3")  # k3 of rho = 2 is 0.307
    assert kept.tolist() == [[0, 1, 0, 0], [1, 1, 0, 0], [0] * 4]
    for options, threshold, message in (("seq_max_k1", "2", "unknown option"), ("token_k1,token_k2", "1,2,3", "one "
                                        "per option"), ("token_k2", "0.5_2", "one upper bound"), ("token_k1", "a",
                                                                                                 "not a number")):
        with pytest.raises(ValueError, match=message):
            rc(rs=options, rs_threshold=threshold)
