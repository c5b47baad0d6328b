"""Partial rollouts (train_grpo --partial-rollouts, --max-staleness): agent trajectories carried across steps. A
step's rollout phase ends once it holds its groups complete; the other trajectories pause between turns, with their
tokens, engine logprobs, versions and live tools, and go on in the next phase under the new weights.

This module is their one owner. rollout.multi_turn runs its plain loop unless it is handed an `InFlight`, which then
drives that same loop (`InFlight.run_phase`): it adds the trajectories it carries, ends the rollout early and keeps
what it does not return. The trainer's side (set-up from a checkpoint, what a checkpoint keeps, the prompts a step
takes, the staleness metrics, the closing) is the functions at the bottom, which do nothing without partial rollouts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import collectives
import task_rows
from rollout import Sample, Trajectory, close_all


def staleness(traj: Trajectory, version: int) -> int:
    """How many versions older than `version` the trajectory's oldest token is (0 for one with no token yet)."""
    return version - min(traj.versions, default=version)


def due(traj: Trajectory, version: int, max_staleness: int) -> bool:
    """Whether an unfinished trajectory must finish in the phase of `version`: carried into the next phase, its
    oldest token (this phase's, if it has no older one) would be more than `max_staleness` versions old."""
    return bool(not traj.finish_reason and traj.completion_ids and staleness(traj, version) + 1 > max_staleness)


def complete_groups(trajectories: list[Trajectory]) -> list[int]:
    """Ids, in order, of the groups whose every trajectory has finished."""
    live = {traj.group for traj in trajectories if not traj.finish_reason}
    return sorted({traj.group for traj in trajectories} - live)


@dataclass
class Ending:
    """When the phase of `version` may end (rollout.run_trajectories' stop_when): it holds `groups` complete groups
    and no unfinished trajectory is `due`. It notes when it first held them, for rollout/due_wait_seconds."""

    groups: int
    max_staleness: int
    version: int
    had_groups_at: float | None = None  # time.monotonic()

    def reached(self, trajectories: list[Trajectory]) -> bool:
        """Whether the phase may end now, asked each time tool results are in."""
        have_groups = len(complete_groups(trajectories)) >= self.groups
        if have_groups and self.had_groups_at is None:
            self.had_groups_at = time.monotonic()
        return have_groups and not any(due(traj, self.version, self.max_staleness) for traj in trajectories)


@dataclass
class InFlight:
    """What one rollout phase hands to the next. A phase ends once `groups` groups are complete (all their
    trajectories finished; a group is never split) and returns that many; the trajectories of the other groups stay
    here, the unfinished ones paused between turns with their tokens, engine logprobs, versions and live toolbox (no
    tool call runs while paused), to go on in the next phase under its weights. No trajectory is carried past
    `max_staleness`: one whose oldest token would be more than that many versions old in the next phase is due, and
    the phase waits for it to finish (its work is never thrown away). A complete group left waiting past the bound
    (more groups completed than a phase takes) restarts from its prompts in the next phase, on fresh toolboxes.
    `regenerate`: groups (id, row) to start from their prompts in the next phase (a resumed run's: its paused
    trajectories were not checkpointed). `close` releases every toolbox it holds: call it on every exit path."""

    groups: int
    max_staleness: int
    trajectories: list[Trajectory] = field(default_factory=list)
    regenerate: list[tuple[int, dict]] = field(default_factory=list)
    paused_at: float = 0.0  # time.monotonic() when the last phase ended

    def group_ids(self) -> list[int]:
        """The groups it holds, carried or to regenerate: what a checkpoint keeps, and whether a step starts any."""
        return sorted({traj.group for traj in self.trajectories} | {group for group, _ in self.regenerate})

    def close(self) -> None:
        """Close every toolbox it holds, each even when another's close fails; nothing stays in flight."""
        boxes, self.trajectories = [traj.box for traj in self.trajectories], []
        close_all(boxes)

    def run_phase(self, run: Callable, starts: list[tuple[int, int, dict]], group_size: int,
                  version: int) -> tuple[list[Trajectory], dict]:
        """rollout.multi_turn's hook: its loop `run` (starts, carried, stop_when) as the phase of `version`. The
        trajectories of `starts` ((group, index, row) to start from their prompts) run with those this holds (the
        stale ones restarted) and its groups to regenerate, until `Ending`; returns the trajectories of `groups`
        complete groups, chosen stalest first (then by group id), in group order, with the loop's metrics and the
        partial/ ones and rollout/due_wait_seconds (how long it waited for due trajectories once it had its groups).
        The rest stay here, paused; after an error or Ctrl-C none does (`run` closes every toolbox)."""
        carried, starts, metrics = resume(self, version, group_size, starts)
        ending = Ending(self.groups, self.max_staleness, version)
        trajectories, run_metrics = run(starts, carried, ending.reached)
        now = time.monotonic()
        returned = set(stalest_first(trajectories, version)[: self.groups])
        paused = [traj for traj in trajectories if traj.group not in returned]
        self.trajectories, self.paused_at = paused, now
        return [traj for traj in trajectories if traj.group in returned], run_metrics | metrics | {
            "rollout/due_wait_seconds": now - (ending.had_groups_at or now),
            "partial/paused": float(sum(not traj.finish_reason for traj in paused)),
            "partial/groups_in_flight": float(len({traj.group for traj in paused}))}


def resume(in_flight: InFlight, version: int, group_size: int,
           starts: list[tuple[int, int, dict]]) -> tuple[list[Trajectory], list[tuple[int, int, dict]], dict]:
    """Take in_flight's trajectories into a phase of `version`: (those that go on, their paused time taken off their
    wall clock; `starts` with the stale ones' and the regenerated groups' trajectories in front; partial/ metrics).
    The stale ones' toolboxes are closed, and on an error the others' too."""
    carried, in_flight.trajectories = in_flight.trajectories, []
    regenerated, in_flight.regenerate = in_flight.regenerate, []
    stale = [traj for traj in carried if staleness(traj, version) > in_flight.max_staleness]
    kept = [traj for traj in carried if staleness(traj, version) <= in_flight.max_staleness]
    try:
        close_all([traj.box for traj in stale])
    except BaseException:
        close_all([traj.box for traj in kept])
        raise
    for traj in kept:
        traj.started += time.monotonic() - in_flight.paused_at
    starts = ([(traj.group, traj.index, traj.row) for traj in stale]
              + [(group, index, row) for group, row in regenerated for index in range(group_size)] + starts)
    return kept, starts, {"partial/resumed": float(sum(not traj.finish_reason for traj in kept)),
                          "partial/restarted_stale": float(len(stale)),
                          "partial/regenerated": float(len(regenerated) * group_size)}


def stalest_first(trajectories: list[Trajectory], version: int) -> list[int]:
    """The complete groups, those with the oldest tokens first (then by group id): they are the next to be
    restarted, so they are the first to be returned."""
    age = {}
    for traj in trajectories:
        age[traj.group] = max(age.get(traj.group, 0), staleness(traj, version))
    return sorted(complete_groups(trajectories), key=lambda group: (-age[group], group))


# The trainer's side (train_grpo): each function takes the run's InFlight, None without --partial-rollouts, and then
# does nothing (but setup, which makes it).


def setup(args, state: dict, rows: list[dict], rank: int, world: int) -> InFlight | None:
    """The InFlight of a run with args.partial_rollouts (each rank's share of args.prompts_per_step groups a phase,
    args.max_staleness), None without. The groups a resumed run's checkpoint held in flight (`checkpoint_state`) start
    again from their prompts, each rank its share: their ids are their rows' data positions (`first_group`)."""
    if not args.partial_rollouts:
        return None
    in_flight = InFlight(groups=args.prompts_per_step // world, max_staleness=args.max_staleness)
    regenerated = state.get("in_flight_groups", [])
    in_flight.regenerate = [(group, task_rows.in_epoch_order(rows, group, 1, args.seed)[0])
                            for group in regenerated[rank::world]]
    if regenerated and rank == 0:
        print(f"--partial-rollouts: the {len(regenerated)} groups in flight at the checkpoint start again from "
              "their prompts (paused trajectories and their tools are not checkpointed: dropped)")
    return in_flight


def prompts_per_rank(in_flight: InFlight | None, per_rank: int) -> int:
    """How many new prompts each rank takes in a round: its share, or twice that in a step with no group in flight on
    any rank (the first): a phase then has groups to return and as many to carry. Collective with partial rollouts."""
    starting = in_flight is not None and not collectives.any_rank(bool(in_flight.group_ids()))
    return per_rank * (2 if starting else 1)


def first_group(in_flight: InFlight | None, data_pos: int, round_first_group: int) -> int:
    """Where a round's group ids start (before each rank's offset): `round_first_group`, unique over the step's
    rounds; with partial rollouts the round's data position, unique over steps too (groups are carried across them)
    and where a resumed run finds the row again (`setup`)."""
    return round_first_group if in_flight is None else data_pos


def staleness_metrics(in_flight: InFlight | None, step: int, batch: list[Sample]) -> dict:
    """How many steps before `step` each trained token was sampled (step minus its version): mean and max over the
    loss-mask tokens of every rank's batch. Collective with partial rollouts."""
    if in_flight is None:
        return {}
    ages = [step - v for s in batch for v, m in zip(s.versions, s.loss_mask) if m]
    tokens = collectives.sum_over_ranks(len(ages))
    return {"partial/staleness_mean": collectives.sum_over_ranks(sum(ages)) / max(tokens, 1),
            "partial/staleness_max": float(max(collectives.gather_objects([max(ages, default=0)])))}


def checkpoint_state(in_flight: InFlight | None) -> dict:
    """What a checkpoint keeps of the groups in flight: their ids over every rank, for `setup` to start them again
    from their prompts (their trajectories and tools are not kept). Collective with partial rollouts."""
    if in_flight is None:
        return {}
    return {"in_flight_groups": sorted(collectives.gather_objects(in_flight.group_ids()))}


def close(in_flight: InFlight | None) -> None:
    """Release the paused trajectories' tools (sessions, containers): training has ended, however it ended."""
    if in_flight is not None:
        in_flight.close()
