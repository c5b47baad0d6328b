"""Independent trajectories (rollout.run_trajectories): with an engine whose replies depend only on a trajectory's
tokens, scheduling each trajectory at its own pace gives exactly the samples of the lockstep reference, whatever the
tool latencies; no trajectory waits for another's tools; token-in-token-out holds under any interleaving."""
import dataclasses
import random
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import chat  # noqa: E402
import engines  # noqa: E402
import policy  # noqa: E402
import rollout  # noqa: E402
import tiny  # noqa: E402
import tools  # noqa: E402
import train_grpo  # noqa: E402
from test_grpo_variants import LengthsEngine, make_run, position_rewards  # noqa: E402
from test_grpo_variants import task as grpo_task  # noqa: E402,F401 -- a fixture

CORPUS = ["def add(a, b):\n    return a + b\nprint(add(1, 2))\n", "The answer is 3. Let me check with python.",
          '{"name": "python", "arguments": {"code": "print(1)"}}', "ran print(x) after 3 ms"] * 20


def call(code: str) -> str:
    return f'<tool_call>\n{{"name": "python", "arguments": {{"code": "{code}"}}}}\n</tool_call>'


# Each trajectory's script: its assistant turns in order. Different lengths, several calls a turn, a malformed call,
# a run past max_turns, a reply past max_total_tokens.
SCRIPTS = {
    "task-A": ["The answer is 3."],
    "task-B": ["Let me check." + call("print(1)"), call("print(add(1, 2))"), "The answer is 3."],
    "task-C": [call(f"print({k})") for k in range(8)],  # stops at max_turns
    "task-D": [call("a = 1") + call("print(a)"), "def add(a, b):\n    return a + b"],
    "task-E": ["<tool_call>{oops</tool_call>", "print(add(1, 2)) " * 60],  # the second reply runs out of room
    "task-F": [call("x = 2"), call("print(x)"), call("print(x + 1)"), "done"],
}
LIMITS = rollout.AgentLimits(max_turns=5, max_total_tokens=700, max_tool_response_tokens=16)


class TokenEngine:
    """Replies that depend only on the trajectory's tokens: the script is the one whose marker the prompt holds, the
    turn the number of assistant headers in it; each token's logprob is a function of its position and id. Records
    each call's size; `on_reply(marker, turn)` sees every reply once it is made."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]], on_reply=lambda marker, turn: None):
        self.tokenizer, self.scripts, self.on_reply = tokenizer, scripts, on_reply
        user = [{"role": "user", "content": "x"}]
        self.header = chat.render(tokenizer, user, None, True)[len(chat.render(tokenizer, user, None, False)):]
        self.eot = tokenizer.convert_tokens_to_ids(chat.end_of_turn(tokenizer))
        self.sizes = []

    def generate(self, prompts, sampling):
        self.sizes.append(len(prompts))
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            marker = next(m for m in self.scripts if m in text)
            turn = text.count(self.header) - 1
            ids = self.tokenizer(self.scripts[marker][turn], add_special_tokens=False)["input_ids"] + [self.eot]
            logprobs = [-(1 + (len(prompt) + k) % 7 + t % 5) / 8 for k, t in enumerate(ids)]
            out.append(engines.truncate_at_stop(ids[: sampling.max_new_tokens], logprobs[: sampling.max_new_tokens],
                                                {self.eot}))
            self.on_reply(marker, turn)
        return out


def latency_toolbox(seed: int, most_seconds: float = 0.02):
    """A `python` tool that answers after a random delay (its own generator per toolbox, seeded by `seed` and the
    row) with a text that depends only on the code."""
    def new_toolbox(row):
        rng, lock = random.Random(f"{seed}-{row['prompt'][0]['content']}"), threading.Lock()

        def python(arguments):
            with lock:
                delay = rng.uniform(0, most_seconds)
            time.sleep(delay)
            return tools.ToolResult(f"ran {arguments['code']}")
        return tools.ToolBox({"python": python}, [tools.PYTHON_TOOL])
    return new_toolbox


ROWS = [{"prompt": [{"role": "user", "content": f"{marker}: solve it"}]} for marker in SCRIPTS]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return policy.load_tokenizer(tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS))


@pytest.fixture(scope="module")
def lockstep(tokenizer):
    """The reference: every turn of every trajectory in one engine call, tools without delay."""
    engine = TokenEngine(tokenizer, SCRIPTS)
    samples, metrics = rollout.multi_turn(engine, tokenizer, ROWS, 2, engines.Sampling(max_new_tokens=200),
                                          latency_toolbox(0, 0.0), LIMITS, lockstep=True)
    return samples, metrics, engine.sizes


def fields(sample: rollout.Sample) -> dict:
    """Everything a sample holds that the schedule must not change (not its wall-clock seconds)."""
    info = {k: v for k, v in sample.info.items() if k != "agent_seconds"}
    info["tool_log"] = [{k: v for k, v in call.items() if k != "seconds"} for call in info["tool_log"]]
    return {"prompt_ids": sample.prompt_ids, "completion_ids": sample.completion_ids, "loss_mask": sample.loss_mask,
            "engine_logprobs": sample.engine_logprobs, "finish_reason": sample.finish_reason, "text": sample.text,
            "group": sample.group, "info": info}


def test_lockstep_reference_covers_every_ending(lockstep):
    samples, _, sizes = lockstep
    reasons = {s.row["prompt"][0]["content"].split(":")[0]: s.finish_reason for s in samples}
    assert reasons == {"task-A": "stop", "task-B": "stop", "task-C": "max_turns", "task-D": "stop",
                       "task-E": "max_total_tokens", "task-F": "stop"}
    assert sizes == [12, 10, 6, 4, 2]  # one call a turn, each with every live trajectory


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_independent_schedule_gives_the_lockstep_samples_under_random_latencies(tokenizer, lockstep, seed):
    reference, _, lockstep_sizes = lockstep
    engine = TokenEngine(tokenizer, SCRIPTS)
    samples, metrics = rollout.multi_turn(engine, tokenizer, ROWS, 2, engines.Sampling(max_new_tokens=200),
                                          latency_toolbox(seed), LIMITS)
    assert [fields(s) for s in samples] == [fields(s) for s in reference]
    for s in samples:  # token-in-token-out and masks, whatever the interleaving
        assert chat.check_tito(tokenizer, s, s.info["messages"], s.info["tools"]) == {}
        assert s.info["tool_calls"] == sum(m["role"] == "tool" for m in s.info["messages"])
    assert sum(engine.sizes) == sum(lockstep_sizes)  # every turn generated once,
    assert len(engine.sizes) > len(lockstep_sizes)  # some apart from the others (tools return 0-20 ms apart)
    assert metrics["rollout/engine_calls"] == len(engine.sizes)
    assert metrics["rollout/in_flight_mean"] == pytest.approx(sum(engine.sizes) / len(engine.sizes))
    assert 0 < metrics["tools/busy_frac"] <= 1 and 0 < metrics["rollout/engine_busy_frac"] <= 1


class SampledThenScripted:
    """The tiny model's own reply (HFEngine at temperature 1, a few tokens, with the rollout's seeds), then the
    trajectory's scripted turn (TokenEngine's, tool calls and all): trajectories run several turns whatever a random
    model writes, and every turn's prompt holds what the model sampled before."""

    sampled = 6  # tokens of each reply the model samples, whatever the call's budget (a batch's longest room)

    def __init__(self, model, tokenizer, scripts):
        self.hf, self.scripted = engines.HFEngine(model, tokenizer.pad_token_id), TokenEngine(tokenizer, scripts)
        # The sampled part never writes the template's and the tool protocol's tokens: a random model's <tool_call>
        # in a turn its script ends would ask for a turn the script does not have.
        self.hf.banned = sorted(tokenizer.added_tokens_decoder)

    def generate(self, prompts, sampling, seeds=None):
        free = self.hf.generate(prompts, dataclasses.replace(sampling, max_new_tokens=self.sampled, stop_token_ids=[]),
                                seeds=seeds)
        tails = self.scripted.generate(prompts, engines.Sampling(max_new_tokens=200))
        return [engines.Completion(f.token_ids + t.token_ids, f.logprobs + t.logprobs, t.finish_reason)
                for f, t in zip(free, tails)]


def test_sampled_tokens_do_not_depend_on_the_schedule(tokenizer):
    """The tiny model sampling at temperature 1, each sample and turn from its own seed: whichever trajectories share
    an engine call (random tool latencies, two seeds), every trajectory holds lockstep's token ids, and its engine
    logprobs agree to within 1e-6 (a batch's padding and size move a row's fp32 logits in the last bits on CPU:
    4.8e-7 at most, measured over 169 rows). The engine's own random stream would give other tokens. 1 s."""
    model = policy.load_model(tokenizer.name_or_path).eval()
    sampling = engines.Sampling(max_new_tokens=200, temperature=1.0, seed=7)
    limits = rollout.AgentLimits(max_turns=5, max_total_tokens=900, max_tool_response_tokens=16)
    scripts = {m: SCRIPTS[m] for m in ("task-A", "task-B", "task-D", "task-F")}  # 1-4 turns, 0-2 calls a turn
    rows = [{"prompt": [{"role": "user", "content": f"{m}: solve it"}]} for m in scripts]
    engine = SampledThenScripted(model, tokenizer, scripts)
    reference, _ = rollout.multi_turn(engine, tokenizer, rows, 2, sampling, latency_toolbox(0, 0.0), limits,
                                      lockstep=True)
    sampled = [[t for t, m in zip(s.completion_ids, s.loss_mask) if m][: engine.sampled] for s in reference]
    assert sampled[0] != sampled[1]  # a group's two samples drew differently: sampling, not greedy
    for seed in (1, 2):
        engine.scripted.sizes = []
        samples, _ = rollout.multi_turn(engine, tokenizer, rows, 2, sampling, latency_toolbox(seed), limits)
        assert len(engine.scripted.sizes) > 4  # some turns apart from the others (lockstep makes 4 calls)
        for got, want in zip(samples, reference, strict=True):
            assert (got.completion_ids, got.loss_mask, got.finish_reason) == \
                (want.completion_ids, want.loss_mask, want.finish_reason)
            assert got.engine_logprobs == pytest.approx(want.engine_logprobs, abs=1e-6, rel=0)
    shared = rollout.multi_turn(engine, tokenizer, rows, 2, dataclasses.replace(sampling, seed=None),
                                latency_toolbox(0, 0.0), limits, lockstep=True)[0]
    assert [s.completion_ids for s in shared] != [s.completion_ids for s in reference]


class ContinuousSampledThenScripted(SampledThenScripted):
    """SampledThenScripted through HFEngine's continuous batch: each turn is submitted alone as soon as its trajectory
    is ready, and comes back at the decoding step that ends its sampled part."""

    continuous = True

    def __init__(self, model, tokenizer, scripts):
        super().__init__(model, tokenizer, scripts)
        self.prompts, self.steps_in_flight = {}, []

    def submit(self, key, prompt, sampling, seed=None):
        self.prompts[key] = prompt
        self.hf.submit(key, prompt, dataclasses.replace(sampling, max_new_tokens=self.sampled, stop_token_ids=[]), seed)

    def step(self):
        finished = self.hf.step()
        self.steps_in_flight.append(len(finished) + (len(self.hf.running.requests) if self.hf.running else 0))
        tails = [self.scripted.generate([self.prompts.pop(key)], engines.Sampling(max_new_tokens=200))[0]
                 for key, _ in finished]
        return [(key, engines.Completion(f.token_ids + t.token_ids, f.logprobs + t.logprobs, t.finish_reason))
                for (key, f), t in zip(finished, tails)]

    def abort(self):
        self.hf.abort()
        self.prompts = {}


def test_continuous_engine_gives_the_lockstep_samples(tokenizer):
    """The same rollout through a continuously batching engine (turns join and leave its batch at any decoding step,
    tools with random latencies): every trajectory holds lockstep's token ids and masks, and its engine logprobs agree
    to within 1e-6; no mask drifts (check_tito; the random tokens may split text otherwise than the tokenizer)."""
    model = policy.load_model(tokenizer.name_or_path).eval()
    sampling = engines.Sampling(max_new_tokens=200, temperature=1.0, seed=7)
    limits = rollout.AgentLimits(max_turns=5, max_total_tokens=900, max_tool_response_tokens=16)
    scripts = {m: SCRIPTS[m] for m in ("task-A", "task-B", "task-D", "task-F")}
    rows = [{"prompt": [{"role": "user", "content": f"{m}: solve it"}]} for m in scripts]
    reference, _ = rollout.multi_turn(SampledThenScripted(model, tokenizer, scripts), tokenizer, rows, 2, sampling,
                                      latency_toolbox(0, 0.0), limits, lockstep=True)
    engine = ContinuousSampledThenScripted(model, tokenizer, scripts)
    assert engines.continuous(engine)
    samples, metrics = rollout.multi_turn(engine, tokenizer, rows, 2, sampling, latency_toolbox(3, 0.05), limits)
    for got, want in zip(samples, reference, strict=True):
        assert (got.completion_ids, got.loss_mask, got.finish_reason) == \
            (want.completion_ids, want.loss_mask, want.finish_reason)
        assert got.engine_logprobs == pytest.approx(want.engine_logprobs, abs=1e-6, rel=0)
        assert not chat.mask_drifted(chat.check_tito(tokenizer, got, got.info["messages"], got.info["tools"]))
    turns = sum(s.info["turns"] for s in samples)
    assert metrics["rollout/engine_calls"] == len(engine.steps_in_flight) >= engine.sampled * 4  # steps, not calls
    assert 1 <= min(engine.steps_in_flight) < max(engine.steps_in_flight) <= len(samples)  # joined and left
    assert sum(engine.steps_in_flight) >= turns  # every turn was in the batch for at least one step


def test_a_failed_rollout_leaves_the_continuous_engine_empty(tokenizer):
    """An engine step that fails mid-rollout (turns of other trajectories still in its batch) propagates, and the
    engine is emptied on the way out: the next weights can load."""
    model = policy.load_model(tokenizer.name_or_path).eval()
    engine = ContinuousSampledThenScripted(model, tokenizer, {m: SCRIPTS[m] for m in ("task-B", "task-F")})
    step = engine.step

    def failing_step():
        if len(engine.steps_in_flight) == 8:
            raise RuntimeError("the engine died")
        return step()

    engine.step = failing_step
    rows = [{"prompt": [{"role": "user", "content": f"{m}: solve it"}]} for m in ("task-B", "task-F")]
    with pytest.raises(RuntimeError, match="the engine died"):
        rollout.multi_turn(engine, tokenizer, rows, 2, engines.Sampling(max_new_tokens=200, temperature=1.0, seed=7),
                           latency_toolbox(0), LIMITS)
    assert engine.steps_in_flight[-1] > 0  # turns were in the batch when it failed
    assert engine.hf.running is None and not engine.hf.queued
    engine.hf.load_weights(model.state_dict().items())


def test_no_trajectory_waits_for_another_ones_tool(tokenizer):
    """task-S's only tool call returns once every other trajectory has had its last reply: under lockstep that would
    never happen (their next turns wait for this tool), so the tool would give up after 20 s and say so."""
    others = {m: len(s) for m, s in SCRIPTS.items() if m not in ("task-C", "task-E")}  # those end by a limit
    replied, all_done = {}, threading.Event()

    def on_reply(marker, turn):
        replied[marker] = turn + 1
        if all(replied.get(m) == n for m, n in others.items()):
            all_done.set()

    def new_toolbox(row):
        if "task-S" not in row["prompt"][0]["content"]:
            return latency_toolbox(0)(row)
        return tools.ToolBox({"python": lambda a: tools.ToolResult("waited" if all_done.wait(20) else "gave up")},
                             [tools.PYTHON_TOOL])

    scripts = {"task-S": [call("slow()"), "done"]} | {m: SCRIPTS[m] for m in others}
    rows = [{"prompt": [{"role": "user", "content": f"{m}: solve it"}]} for m in scripts]
    engine = TokenEngine(tokenizer, scripts, on_reply)
    samples, metrics = rollout.multi_turn(engine, tokenizer, rows, 1, engines.Sampling(max_new_tokens=200),
                                          new_toolbox, LIMITS)
    slow = samples[0]
    assert slow.info["messages"][-2]["content"] == "waited" and slow.finish_reason == "stop"
    assert all(s.finish_reason == "stop" for s in samples)
    assert engine.sizes[-1] == 1  # the slow trajectory's last turn came alone, after the others had finished
    assert metrics["tools/running_max"] >= 2


def test_rollout_correction_flags_reach_the_loss(grpo_task, tmp_path):
    """The scripted engine's logprobs (-1 a token) are far above the tiny model's (about -6 at vocab 512): every ratio
    is about e^-5. Token rejection within [1/2, 2] drops every token (no loss, no gradient); sequence weights are the
    capped products, ~0, over the same tokens."""
    rejected = make_run(grpo_task, tmp_path / "rs", LengthsEngine([3], stop_id=2), position_rewards(2),
                        prompts_per_step=2, group_size=2, max_new_tokens=8, rollout_rs="token_k1",
                        rollout_rs_threshold="2")
    metrics = train_grpo.train_step(rejected)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1.0)
    assert metrics["actor/pg_loss"] == 0 and metrics["actor/grad_norm"] == 0
    assert metrics["rollout_corr/kl"] > 3  # E[engine - old]: about -1 - (-6)
    weighted = make_run(grpo_task, tmp_path / "is", LengthsEngine([3], stop_id=2), position_rewards(2),
                        prompts_per_step=2, group_size=2, max_new_tokens=8, rollout_is="sequence")
    metrics = train_grpo.train_step(weighted)
    assert 0 < metrics["rollout_corr/rollout_is_mean"] < 1e-4 and "rollout_corr/rollout_rs_masked_fraction" not in metrics
    with pytest.raises(ValueError, match="--tis-cap is rollout correction's token-level weight"):
        train_grpo.check_args(train_grpo.Args(model="m", data="d", tis_cap=2.0, rollout_is="token"), 1)


class PeerEngine(TokenEngine):
    """TokenEngine driven by two ranks together, as a tensor-parallel vLLM engine is: each call gathers both ranks'
    prompts (a collective: a rank that skipped a call would hang the other), generates all of them, and returns this
    rank's share."""

    def __init__(self, tokenizer, scripts):
        super().__init__(tokenizer, scripts)
        self.tp_group = torch.distributed.group.WORLD

    def generate(self, prompts, sampling):
        parts = [None, None]
        torch.distributed.all_gather_object(parts, prompts, group=self.tp_group)
        everything = super().generate([p for part in parts for p in part], sampling)
        first = len(parts[0]) if torch.distributed.get_rank() == 1 else 0
        return everything[first : first + len(prompts)]


def _peer_rank(rank: int, model_dir: str, store: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    tokenizer = policy.load_tokenizer(model_dir)
    mine = ["task-C", "task-F"] if rank == 0 else ["task-A"]  # rank 1 is done long before rank 0
    rows = [{"prompt": [{"role": "user", "content": f"{m}: solve it"}]} for m in mine]
    engine = PeerEngine(tokenizer, SCRIPTS)
    samples, metrics = rollout.multi_turn(engine, tokenizer, rows, 2, engines.Sampling(max_new_tokens=200),
                                          latency_toolbox(rank), LIMITS)
    reference, _ = rollout.multi_turn(TokenEngine(tokenizer, SCRIPTS), tokenizer, rows, 2,
                                      engines.Sampling(max_new_tokens=200), latency_toolbox(0, 0.0), LIMITS,
                                      lockstep=True)
    calls = [None, None]
    torch.distributed.all_gather_object(calls, metrics["rollout/engine_calls"])
    Path(out, f"rank{rank}").write_text(repr(([fields(s) for s in samples] == [fields(s) for s in reference],
                                              calls)))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_peers_meet_at_each_engine_call_and_nowhere_else(tokenizer, tmp_path):
    """Two ranks sharing one engine (its calls are collective): the rank whose trajectories end first keeps calling
    with no prompts while the other still generates; both get the lockstep reference's samples. Two spawned
    processes (imports dominate): 100 s on the 2-core machine at load 10."""
    model_dir = tokenizer.name_or_path
    torch.multiprocessing.spawn(_peer_rank, args=(model_dir, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    results = [eval((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]  # noqa: S307 -- our own repr
    assert [same for same, _ in results] == [True, True]
    calls = results[0][1]
    assert calls[0] == calls[1] and calls[0] >= 5  # one call a turn of task-C at least, made by both ranks
