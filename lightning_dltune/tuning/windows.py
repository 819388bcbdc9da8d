"""When a window is judged: :data:`JUDGED_EARLY`, the rules that judge a trial's window before ``min_steps`` (or its
epoch's end), and :data:`RUNS_ON`, those that keep it open past them. Each is a function of the trials (the last is
the window so far), the policy and the budget; the first that holds names the reason. Evidence for each:
``docs/how-it-decides.md``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from lightning_dltune._stats import few
from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.tuning.compare import every_step_slower, faster_by, won_over_start
from lightning_dltune.tuning.model import Budget, Policy, Trial, contends_in_lockstep, estimate, handover_s, host_busy


def plainly_input_bound(stats: WindowStats, policy: Policy = Policy()) -> bool:
    """Whether training plainly waits for the loader: after ``early_steps`` steps, the stall's lower confidence bound
    (and the GPU's stall, where measured) is at least ``early_stall``, or every step's was
    (:func:`_every_step_stalled`)."""

    if stats.steps < policy.early_steps:
        return False
    gpu = stats.gpu_stall_frac
    return (stats.stall_lower_bound() >= policy.early_stall or _every_step_stalled(stats, policy)) and (
        gpu is None or gpu >= policy.early_stall
    )


def _every_step_stalled(stats: WindowStats, policy: Policy) -> bool:
    """A sign test on the stall: after ``sign_steps`` steps, the least wait is at least ``early_stall`` of a step
    (the mean busy time plus its noise)."""

    if stats.steps < policy.sign_steps or stats.wait_min_s <= 0:
        return False
    busy = max(0.0, stats.mean_wall_s - stats.mean_wait_s) + 2.0 * stats.busy_sem_s
    return stats.wait_min_s / (stats.wait_min_s + busy) >= policy.early_stall


def plain_stall(trials: Sequence[Trial], policy: Policy = Policy(), budget: Budget | None = None) -> bool:
    """The last window's stall is plainly the loader's (:func:`plainly_input_bound`), and not :func:`_too_soon`."""
    return not _too_soon(trials[-1], policy) and plainly_input_bound(trials[-1].stats, policy)


def _too_soon(last: Trial, policy: Policy) -> bool:
    """At 0 workers, a wait mostly the training process's CPU (``cpu_wait_share``) is judged on its stall only after
    ``sign_steps`` steps."""
    s = last.stats
    on_the_cpu = last.settings.num_workers == 0 and 0 < policy.cpu_wait_share * s.wait_s <= s.fetch_cpu_s
    return on_the_cpu and s.steps < policy.sign_steps


def stalled_from_the_start(trials: Sequence[Trial], policy: Policy = Policy(), budget: Budget | None = None) -> bool:
    """At 0 workers, one steady step and the start-up step together show a plain stall, and the model's worker count
    already reaches ``budget.max_workers`` (never without a ``budget``)."""
    last = trials[-1]
    stats = last.stats
    if (
        budget is None
        or _too_soon(last, policy)
        or last.settings.num_workers != 0
        or stats.steps != 1
        or policy.early_steps > 2
        or stats.startup_wait_s <= 0
    ):
        return False
    if not last.usable:  # a batch of no samples
        return False
    w0, w1 = stats.startup_wait_s, stats.mean_wait_s
    # two standard errors low, over two samples and widened for them, as stall_lower_bound takes them over more
    wait = max(0.0, (w0 + w1) / 2 - 2.0 * few(1) * abs(w0 - w1) / 2)
    busy = max(stats.startup_busy_s, stats.mean_wall_s - stats.mean_wait_s)
    gpu = stats.gpu_stall_frac
    if wait <= 0 or wait / (wait + busy) < policy.early_stall or (gpu is not None and gpu < policy.early_stall):
        return False
    # the cap on worker processes only: see docs/how-it-decides.md (too_few_steps)
    return estimate(trials, budget, policy).needed_workers >= budget.max_workers


def sized_on_a_longer_step(trials: Sequence[Trial], policy: Policy = Policy(), budget: Budget | None = None) -> bool:
    """The jump from 0 workers to the last config was sized on a step ``longer_step_share`` longer than it has now,
    and it still stalls beyond noise after ``early_steps`` steps: the next jump can be sized now."""

    usable = [t for t in trials if t.usable]
    if len(usable) < 2 or usable[-1] is not trials[-1]:
        return False
    last, before = usable[-1], usable[-2]
    if before.settings.num_workers != 0 or last.settings.num_workers == 0 or last.stats.steps < policy.early_steps:
        return False
    busy_now, busy_then = host_busy(last), host_busy(before)  # the step the jump was sized on
    return busy_now < policy.longer_step_share * busy_then and last.stats.stall_lower_bound() > policy.stall_threshold


def stalls_with_workers(trials: Sequence[Trial], policy: Policy = Policy(), budget: Budget | None = None) -> bool:
    """With workers, the stall's lower confidence bound is above ``stall_threshold`` after ``min_steps`` steps: the
    next move need not wait for the epoch's end."""

    last = trials[-1]
    s = last.stats
    return (
        last.settings.num_workers > 0 and s.steps >= policy.min_steps and s.stall_lower_bound() > policy.stall_threshold
    )


def contention_foreseen(trials: Sequence[Trial], policy: Policy = Policy(), budget: Budget | None = None) -> bool:
    """At 0 workers, after ``sign_steps`` steps, the step computes on the CPUs in lockstep (two threads or more) and
    the model already predicts workers beside it would stretch it (:func:`~.model.contended_s`): what to do about it
    (load an epoch ahead, or stay) does not wait for a stall the loading in the training process keeps near half
    (never without a ``budget``)."""
    last = trials[-1]
    if budget is None or last.settings.num_workers != 0 or last.stats.steps < policy.sign_steps or not last.usable:
        return False
    return contends_in_lockstep(estimate([last], budget, policy), handover_s([last], policy))


def slower_than_before(trials: Sequence[Trial], policy: Policy = Policy(), budget: Budget | None = None) -> bool:
    """Every step of the last window, after twice ``sign_steps`` steps, was slower per sample than the config it left
    (:func:`~lightning_dltune.tuning.compare.every_step_slower`): a trial that is plainly worse ends at once."""
    usable = [t for t in trials if t.usable]
    if len(usable) < 2 or usable[-1] is not trials[-1] or usable[-2].settings == trials[-1].settings:
        return False
    # twice the sign test's steps: a new loader's first steps can be slowed while its workers fill their prefetch
    return trials[-1].stats.steps >= 2 * policy.sign_steps and every_step_slower(trials[-1], usable[-2], policy)


WindowRule = Callable[[Sequence[Trial], Policy, "Budget | None"], bool]
# the reasons to judge a window before ``min_steps`` or its epoch's end, in the order they are asked
JUDGED_EARLY: tuple[WindowRule, ...] = (
    plain_stall,
    stalled_from_the_start,
    sized_on_a_longer_step,
    stalls_with_workers,
    contention_foreseen,
    slower_than_before,
)


def judged_early(trials: Sequence[Trial], policy: Policy = Policy(), budget: Budget | None = None) -> str | None:
    """The first of :data:`JUDGED_EARLY` that holds for the last trial's window (its name), or ``None``."""
    return next((rule.__name__ for rule in JUDGED_EARLY if rule(trials, policy, budget)), None)


def still_open(trials: Sequence[Trial], policy: Policy = Policy(), budget: Budget | None = None) -> bool:
    """The last window, short of ``open_windows * min_steps`` steps, falls short of ``min_gain`` over the fastest
    earlier config while its noise could still make it a win: it runs on."""

    last = trials[-1]
    if not last.usable or last.stats.steps >= policy.open_windows * policy.min_steps:
        return False
    earlier = [t for t in trials[:-1] if t.usable and t.settings != last.settings]
    if not earlier:
        return False
    prev = min(earlier, key=lambda t: t.compared_sec_per_sample)
    gain, noise = faster_by(prev, last)
    return gain < policy.min_gain * prev.compared_sec_per_sample <= gain + noise


def win_not_yet_shown(trials: Sequence[Trial], policy: Policy = Policy(), budget: Budget | None = None) -> bool:
    """The last window, the fastest so far and short of ``open_windows * min_steps`` steps, reads faster than a start
    at 0 workers but not yet beyond noise: it runs on where judging it now would settle back on that start."""

    start, last = trials[0], trials[-1]
    if start is last or not (start.usable and last.usable) or start.settings.num_workers:
        return False
    if last.stats.steps >= policy.open_windows * policy.min_steps or start.settings == last.settings:
        return False
    if any(t.usable and t.compared_sec_per_sample < last.compared_sec_per_sample for t in trials[:-1]):
        return False  # another config is the likelier pick: more of this one's steps would not change it
    gain, noise = faster_by(start, last)
    could_win = gain + noise > policy.min_gain * start.compared_sec_per_sample
    return gain > 0 and could_win and not won_over_start(start, last, policy)


# the reasons a window runs on past its steps, in the order they are asked
RUNS_ON: tuple[WindowRule, ...] = (still_open, win_not_yet_shown)


def whole_epoch(stats: WindowStats) -> WindowStats:
    """A window judged on its whole epoch (a config loading it ahead, ``rules.load_epoch_ahead``): no block of steps
    is left out of the time compared, since the slow ones are the burst's. Its start-up step stays out, as every
    window's does: the loader's start is priced apart (``startup_s``), and later epochs' bursts are steps."""
    if stats.steps == 0:
        return stats
    busy = (stats.step_s + stats.other_s) / stats.steps
    return replace(
        stats,
        wall_trim_s=stats.mean_wall_s,
        wall_trim_sem_s=stats.wall_sem_s,
        busy_trim_s=busy,
        busy_trim_sem_s=stats.busy_sem_s,
    )


def steady_from_the_start(stats: WindowStats, policy: Policy = Policy()) -> WindowStats:
    """A window at 0 workers that has only its start-up step, as one steady step where that step's samples (at least
    ``startup_samples``, timed one by one) show it is one; else ``stats`` as it is. Its wait: the samples' count
    times the mean of all but the first, two standard errors low, never above the step's whole wait."""

    n, rest, samples = stats.startup_samples, stats.startup_samples - 1, stats.startup_step_samples
    if stats.steps != 0 or n < max(3, policy.startup_samples) or stats.startup_wait_s <= 0 or samples <= 0:
        return stats
    low = stats.startup_sample_mean_s - 2.0 * few(rest - 1) * stats.startup_sample_sem_s
    wait = min(stats.startup_wait_s, n * low)
    if wait <= 0:
        return stats
    busy = stats.startup_busy_s
    return replace(
        stats,
        steps=1,
        samples=samples,
        wall_s=wait + busy,
        wait_s=wait,
        step_s=busy,
        other_s=0.0,
        wait_p50_s=wait,
        wait_p90_s=wait,
        wall_trim_s=wait + busy,
        busy_trim_s=busy,
        busy_p50_s=busy,
        busy_min_s=busy,
        wait_min_s=wait,
        sample_wall_min_s=(wait + busy) / samples,
        fetch_cpu_s=stats.startup_fetch_cpu_s,
        startup_wait_s=wait,
        startup_busy_s=busy,
    )
