"""Seamless epochs: the workers load epoch e+1's first batches while epoch e's last ones are consumed.

PyTorch starts every epoch with an empty pipeline: a persistent iterator is reset (its workers drained, then
refilled from the new epoch's first batch), a non-persistent one is created anew, so the first batches of every
epoch wait a whole production time. Where the next epoch's order is known before it begins, :class:`Seamless`
removes that wait: the train loader's :class:`~lightning_dltune.switch.ResumableBatchSampler` goes on into the
next epoch's batches, the :class:`~lightning_dltune.switch.GuardedIterator` ends the epoch at its length, and
the next ``iter(loader)`` gets the same iterator back, its pipeline already full.

The order is known early, and drawn exactly as at the epoch's start, for:

- a ``SequentialSampler`` (no shuffling);
- a sampler with ``set_epoch`` (``DistributedSampler``: every DDP run), set to the epoch before the draw;
- a ``RandomSampler`` with its own generator (``DataLoader(..., generator=g)``). A run that creates an iterator
  every epoch draws its workers' base seed from that generator just before the order: that draw is made too.

A ``RandomSampler`` without a generator draws its seed from the global random state when its epoch starts, after
training has used it (dropout, augmentation in the main process): drawing it earlier would change the order, so
there it stays off with ``seamless_epochs="auto"``. With ``seamless_epochs=True`` such a sampler is given a
generator seeded from the run's seed and the epoch (``torch.initial_seed() * 1_000_003 + epoch``): the order is
then reproducible but not the one a run without the tuner would draw. Other samplers are on only with ``True``.

Epochs cut short (``limit_train_batches``, a reload for a new config, the last epoch) drop what was drawn ahead:
the orders are forgotten and the generators put back, so the next epoch draws exactly as without seamless epochs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from lightning_dltune._warn import info_once
from lightning_dltune.switch import GuardedIterator, ResumableBatchSampler

SEAMLESS = ("auto", True, False)


class Seamless:
    """Carries the train iterator from one epoch into the next.

    Args:
        setting: ``"auto"`` (where the next epoch's order is known), ``True`` (every sampler; a ``RandomSampler``
            without a generator gets an epoch-seeded one), ``False`` (never).
        epoch: the running epoch (``trainer.current_epoch``).
        base_draws: whether a run without the tuner creates an iterator every epoch (the user's loader is not
            persistent), drawing a base seed from the loader's generator.
        serve: ``serve(loader, take, draws_base)`` makes ``iter(loader)`` start from ``take(loader)`` when that
            returns an iterator, and a new iterator draw its base seed only when ``draws_base()``;
            ``release(loader)`` lets a persistent loader forget its iterator; ``shutdown(loader, iterator)`` stops
            an iterator's workers unless the loader holds it (the loader switcher passes
            ``lightning_dltune._lightning``'s).

    Attributes:
        carried: how many epochs began on an iterator carried over from the epoch before.
    """

    def __init__(
        self,
        setting: bool | str = "auto",
        epoch: Callable[[], int] = lambda: 0,
        base_draws: Callable[[], bool] = lambda: True,
        serve: Callable[..., None] = lambda loader, take, draws_base: None,
        release: Callable[[DataLoader], None] = lambda loader: None,
        shutdown: Callable[[DataLoader, Iterator[Any]], None] = lambda loader, iterator: None,
    ) -> None:
        self.setting = setting
        self.epoch, self.base_draws = epoch, base_draws
        self._serve, self._release, self._shutdown = serve, release, shutdown
        self._carry: tuple[DataLoader, Iterator[Any]] | None = None
        # the generators' states before each epoch's order was drawn ahead, by epoch: what a drop puts back
        self._saved: dict[int, list[tuple[torch.Generator, torch.Tensor]]] = {}
        self.carried = 0  # epochs that began on a carried iterator

    @property
    def carrying(self) -> bool:
        return self._carry is not None

    def why_not(self, loader: DataLoader) -> str | None:
        """Why ``loader`` cannot go on into the next epoch (``None``: it can)."""
        if self.setting is False:
            return "turned off"
        if not isinstance(loader.batch_sampler, ResumableBatchSampler):
            return "its batches are not drawn by the tuner's batch sampler"
        if loader.num_workers == 0:
            return "no workers"
        sampler = loader.batch_sampler.sampler
        if self.setting is True or isinstance(sampler, SequentialSampler) or hasattr(sampler, "set_epoch"):
            return None
        if isinstance(sampler, RandomSampler) and sampler.generator is not None:
            return None
        if isinstance(sampler, RandomSampler):
            return (
                "its RandomSampler draws each epoch's seed from the global random state when the epoch starts, "
                "after training used it; give the loader a generator (`DataLoader(..., generator=g)`) or pass "
                "`DataLoaderTuner(seamless_epochs=True)` to seed each epoch from the run's seed and the epoch"
            )
        return f"its {type(sampler).__name__} may not draw the next epoch's order ahead; `seamless_epochs=True` lets it"

    def attach(self, loader: DataLoader) -> None:
        """Set ``loader``'s batch sampler to go on into the next epoch, when it can (every build and switch)."""
        sampler = loader.batch_sampler
        if not isinstance(sampler, ResumableBatchSampler):
            return
        why = self.why_not(loader)
        if why is not None and self.setting is not False and loader.num_workers > 0:
            info_once("seamless-off", f"DataLoaderTuner: seamless epochs are off for this loader: {why}.")
        if why is None or self.setting is True:  # with True, every order is drawn epoch-seeded, workers or not
            generator = loader.generator
            sampler.carry_on(lambda ahead: self._before_draw(sampler, generator, ahead), seamless=why is None)
        else:
            sampler.seamless = False
        if why is None:
            self._serve(loader, self._take, self.draws_base)

    def draws_base(self) -> bool:
        """Whether a new iterator of the loader draws its workers' base seed from the user's random state now: a
        run without the tuner creates an iterator, drawing one, in its first epoch and, unless its loader is
        persistent, in every epoch."""
        return self.epoch() == 0 or self.base_draws()

    def _before_draw(self, batches: ResumableBatchSampler, generator: torch.Generator | None, ahead: int) -> None:
        sampler = batches.sampler
        epoch = self.epoch() + ahead
        ours = isinstance(sampler, RandomSampler) and (sampler.generator is None or hasattr(sampler, "_dltune_seeded"))
        if self.setting is True and ours and not hasattr(sampler, "set_epoch"):
            sampler.generator = torch.Generator().manual_seed(torch.initial_seed() * 1_000_003 + epoch)
            sampler._dltune_seeded = True  # type: ignore[attr-defined]
        if ahead < 1:
            return
        own = getattr(sampler, "generator", None)
        generators = {id(g): g for g in (generator, own) if g is not None}.values()
        self._saved[epoch] = [(g, g.get_state()) for g in generators]
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        if generator is not None and self.base_draws():
            torch.empty((), dtype=torch.int64).random_(generator=generator)  # the base seed a new iterator draws

    def epoch_ended(self, guard: Any, go_on: bool) -> None:
        """The train epoch ended on ``guard`` (the loop's iterator): carry its inner iterator into the next epoch
        when ``go_on`` (no reload, no switch pending, not the last epoch) and the epoch ran to its end; else drop
        what was drawn ahead."""
        if not isinstance(guard, GuardedIterator):
            return
        # an iterator switched to 0 workers late in the epoch may have drawn ahead before: dropped below as well
        sampler = guard.loader.batch_sampler
        if go_on and sampler.seamless and guard.position >= len(sampler) and guard.loader.num_workers > 0:
            self._carry = (guard.loader, guard.inner)
            self._release(guard.loader)
            return
        self._drop(guard.loader, guard.inner)

    def _take(self, loader: DataLoader) -> Iterator[Any] | None:
        carry, self._carry = self._carry, None
        if carry is None:
            return None
        if carry[0] is not loader or not loader.batch_sampler.advance():
            self._drop(*carry)
            return None
        epoch = self.epoch()  # what was drawn for this epoch is now its own; later epochs' draws may still go
        self._saved = {e: states for e, states in self._saved.items() if e > epoch}
        self.carried += 1
        return carry[1]

    def drop(self) -> None:
        """Let go of a carried iterator (fit ends, a new loader is built)."""
        carry, self._carry = self._carry, None
        if carry is not None:
            self._drop(*carry)

    def _drop(self, loader: DataLoader, inner: Iterator[Any]) -> None:
        if loader.batch_sampler.forget_upcoming() and self._saved:
            for g, state in self._saved[min(self._saved)]:  # as before the first order drawn ahead
                g.set_state(state)
        self._saved = {}
        self._shutdown(loader, inner)  # a persistent loader's own iterator is reset at the next epoch instead
