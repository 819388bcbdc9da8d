"""Seamless epochs: the workers load epoch e+1's first batches while epoch e's last ones are consumed.

PyTorch starts every epoch with an empty pipeline: a persistent iterator is reset (its workers drained, then
refilled from the new epoch's first batch), a non-persistent one is created anew, so the first batches of every
epoch wait a whole production time. Where the next epoch's order is known before it begins, :class:`Seamless`
removes that wait: the train loader's :class:`~lightning_dltune.switching.switch.ResumableBatchSampler` goes on into the
next epoch's batches, the :class:`~lightning_dltune.switching.switch.GuardedIterator` ends the epoch at its length, and
the next ``iter(loader)`` gets the same iterator back, its pipeline already full.

The order is known early, and drawn exactly as at the epoch's start, for:

- a ``SequentialSampler`` (no shuffling);
- a sampler with ``set_epoch`` (``DistributedSampler``: every DDP run), set to the epoch before the draw;
- a ``RandomSampler`` with its own generator (``DataLoader(..., generator=g)``). A run that creates an iterator
  every epoch draws its workers' base seed from that generator just before the order: that draw is made too.

A ``RandomSampler`` without a generator draws its seed from the global random state when its epoch starts, after
training has used it (dropout, augmentation in the main process). With ``seamless_epochs="auto"`` its next order is
drawn ahead from a copy of the global state as it stands then, which is the order the epoch draws if training
draws nothing more from the global state before the epoch begins (a model on a GPU draws dropout from the GPU's
generator). The epoch's start checks it: the global state must be the copy's; then the seed's draw is made on it,
as without the tuner, and the epoch begins on the carried iterator. Otherwise the epoch draws its order as without
seamless epochs, on a new iterator (the carried one is dropped with what it loaded ahead), and this run drawing
from the global state between epochs, the sampler is not drawn ahead again. With ``seamless_epochs=True`` such a
sampler is given a generator seeded from the run's seed and the epoch (``torch.initial_seed() * 1_000_003 +
epoch``): the order is then reproducible but not the one a run without the tuner would draw. Other samplers are on
only with ``True``.

Epochs cut short (``limit_train_batches``, a reload for a new config, the last epoch) drop what was drawn ahead:
the orders are forgotten and the generators put back, so the next epoch draws exactly as without seamless epochs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from lightning_dltune._warn import info_once
from lightning_dltune.switching.switch import GuardedIterator, ResumableBatchSampler


class Seamless:
    """Carries the train iterator from one epoch into the next.

    Args:
        setting: ``"auto"`` (where the next epoch's order is known), ``True`` (every sampler; a ``RandomSampler``
            without a generator gets an epoch-seeded one), ``False`` (never).
        epoch: the running epoch (``trainer.current_epoch``).
        base_draws: whether a run without the tuner creates an iterator every epoch (the user's loader is not
            persistent), drawing a base seed from the loader's generator.
        untuned_creates: whether a run without the tuner creates its loader's iterator in this epoch, persistent or
            not: the first epoch of its ``fit`` (a resumed one's too), or one that reloads the loader as a new object.
        serve: ``serve(loader, take, draws_base)`` makes ``iter(loader)`` start from ``take(loader)`` when that
            returns an iterator, and a new iterator draw its base seed only when ``draws_base()`` (a loader at 0
            workers is served too, whatever ``setting``: it carries nothing, but creates an iterator every epoch);
            ``release(loader)`` lets a persistent loader forget its iterator; ``shutdown(loader, iterator)`` stops
            an iterator's workers unless the loader holds it (the loader switcher passes
            ``lightning_dltune.switching._lightning``'s).
        goes_on: ``goes_on(ahead)``, whether the fit trains past the epoch ``ahead`` epochs after the running one
            (asked as the loader reaches that epoch's end): nothing past the fit's last epoch is loaded.
        before_epoch: ``before_epoch(generator, epoch)`` makes on ``generator`` (a copy of the global random state)
            the draws that run between epoch ``epoch - 1``'s end and epoch ``epoch``'s start make from the global
            state, where they are known (the validation pass's: see ``EvalLoaders.draws_before``); the epoch's start
            checks the guess all the same.

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
        goes_on: Callable[[int], bool] = lambda ahead: True,
        untuned_creates: Callable[[], bool] = lambda: False,
        before_epoch: Callable[[torch.Generator, int], None] = lambda generator, epoch: None,
        bursts: Callable[[DataLoader], bool] = lambda loader: False,
    ) -> None:
        self.setting = setting
        self.bursts = bursts
        self.before_epoch = before_epoch
        self.epoch, self.base_draws, self.untuned_creates = epoch, base_draws, untuned_creates
        self._serve, self._release, self._shutdown, self._goes_on = serve, release, shutdown, goes_on
        self._carry: tuple[DataLoader, Iterator[Any]] | None = None
        # the generators' states before each epoch's order was drawn ahead, by epoch: what a drop puts back
        self._saved: dict[int, list[tuple[torch.Generator, torch.Tensor]]] = {}
        self.carried = 0  # epochs that began on a carried iterator
        # a RandomSampler without a generator, drawn ahead (see the module's docstring): a copy of the global random
        # state after the latest order drawn ahead, and by epoch the global state its start must find
        self.ahead_of_global = True  # False once training drew from the global state between epochs
        self._global: torch.Generator | None = None
        self._expected: dict[int, torch.Tensor] = {}
        self._base_drawn = False  # the epoch's base seed was drawn already (see _take)

    @property
    def carrying(self) -> bool:
        return self._carry is not None

    @property
    def carried_iterator(self) -> Iterator[Any] | None:
        """The iterator carried into the next epoch (``None``: none is)."""
        return None if self._carry is None else self._carry[1]

    def why_not(self, loader: DataLoader) -> str | None:
        """Why ``loader`` cannot go on into the next epoch (``None``: it can)."""
        if self.setting is False:
            return "turned off"
        if not isinstance(loader.batch_sampler, ResumableBatchSampler):
            return "its batches are not drawn by the tuner's batch sampler"
        if loader.num_workers == 0:
            return "no workers"
        if self.bursts(loader):
            return "the tuner chose it to load each epoch ahead at its start, not beside the last epoch's steps"
        sampler = loader.batch_sampler.sampler
        if self.setting is True or isinstance(sampler, SequentialSampler) or hasattr(sampler, "set_epoch"):
            return None
        if draws_from_global(sampler):
            if self.ahead_of_global:
                return None
            return (
                "its RandomSampler draws each epoch's seed from the global random state when the epoch starts, and "
                "training drew from that state between epochs (dropout or augmentation on the CPU), so the order "
                "could not be drawn ahead; give the loader a generator (`DataLoader(..., generator=g)`) or pass "
                "`DataLoaderTuner(seamless_epochs=True)` to seed each epoch from the run's seed and the epoch"
            )
        if isinstance(sampler, RandomSampler) and sampler.generator is not None:
            return None
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
            sampler.carry_on(
                lambda ahead: self._before_draw(sampler, generator, ahead), seamless=why is None, goes_on=self._goes_on
            )
        else:
            sampler.seamless = False
        if why is None or loader.num_workers == 0:
            # at 0 workers nothing is carried, but each epoch's new iterator still draws a base seed: apart from the
            # user's random state where a run without the tuner would not (its loader's persistent workers)
            self._serve(loader, self._take, self.draws_base)

    def draws_base(self) -> bool:
        """Whether a new iterator of the loader draws its workers' base seed from the user's random state now: a
        run without the tuner creates an iterator, drawing one, in its first epoch, in an epoch that reloads its
        loader as a new object (``untuned_creates``) and, unless its loader is persistent, in every epoch."""
        if self._base_drawn:  # once: see _take
            self._base_drawn = False
            return False
        return self.epoch() == 0 or self.untuned_creates() or self.base_draws()

    def _before_draw(self, batches: ResumableBatchSampler, generator: torch.Generator | None, ahead: int) -> None:
        sampler: Any = batches.sampler
        epoch = self.epoch() + ahead
        ours = isinstance(sampler, RandomSampler) and (sampler.generator is None or hasattr(sampler, "_dltune_seeded"))
        if self.setting is True and ours and not hasattr(sampler, "set_epoch"):
            sampler.generator = torch.Generator().manual_seed(torch.initial_seed() * 1_000_003 + epoch)
            sampler._dltune_seeded = True
        elif self.setting == "auto" and draws_from_global(sampler):
            self._draw_from_global(sampler, epoch, ahead)
        if ahead < 1:
            return
        own = getattr(sampler, "generator", None)
        generators = {id(g): g for g in (generator, own) if g is not None}.values()
        self._saved[epoch] = [(g, g.get_state()) for g in generators]
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        if generator is not None and self.base_draws():
            torch.empty((), dtype=torch.int64).random_(generator=generator)  # the base seed a new iterator draws

    def _draw_from_global(self, sampler: RandomSampler, epoch: int, ahead: int) -> None:
        """Make a RandomSampler without a generator draw epoch ``epoch``'s order: from the global state for the
        running epoch, as without the tuner; ahead, from a seed drawn on a copy of the global state as the epoch's
        start would draw it if training draws nothing more from it (after the base seed a new iterator draws)."""
        sampler._dltune_global = True  # type: ignore[attr-defined]
        if ahead < 1 or not self.ahead_of_global:
            sampler.generator = None
            self._global = None
            return
        if self._global is None:
            self._global = torch.Generator()
            self._global.set_state(torch.get_rng_state())
        self.before_epoch(self._global, epoch)  # validation between the epochs, as a run without the tuner draws it
        if self.base_draws():  # a new iterator's base seed, drawn at the epoch's start before the order's seed
            torch.empty((), dtype=torch.int64).random_(generator=self._global)
        self._expected[epoch] = self._global.get_state()
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=self._global).item())
        sampler.generator = torch.Generator().manual_seed(seed)  # what RandomSampler makes of the seed it draws

    def epoch_ended(self, guard: Any, go_on: bool) -> None:
        """The train epoch ended on ``guard`` (the loop's iterator): carry its inner iterator into the next epoch
        when ``go_on`` (no reload, no switch pending, not the last epoch) and the epoch ran to its end; else drop
        what was drawn ahead."""
        if not isinstance(guard, GuardedIterator) or not isinstance(guard.loader.batch_sampler, ResumableBatchSampler):
            return  # (the user's own loader, as the user built it: nothing drawn ahead)
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
        epoch = self.epoch()
        expected = self._expected.pop(epoch, None)
        missed = expected is not None and not torch.equal(torch.get_rng_state(), expected)
        if missed:  # training drew from the global state since the order was drawn ahead: not this epoch's order
            self.ahead_of_global = False
            _batches(loader).seamless = False
            info_once(
                "seamless-global", f"DataLoaderTuner: seamless epochs stopped for this loader: {self.why_not(loader)}."
            )
        if missed or carry[0] is not loader or not _batches(loader).advance():
            self._drop(*carry)
            # the epoch's start drew a new iterator's base seed from the global state already, where a run without
            # the tuner does (a generator's draw made ahead is put back by the drop: the new iterator makes it)
            self._base_drawn = loader.generator is None
            return None
        if expected is not None:  # the order's seed, drawn from the global state as without the tuner
            torch.empty((), dtype=torch.int64).random_()
        # what was drawn for this epoch is now its own; later epochs' draws may still go
        self._saved = {e: states for e, states in self._saved.items() if e > epoch}
        self.carried += 1
        return carry[1]

    def forget(self) -> None:
        """The orders drawn ahead were forgotten and the random state put back (by :meth:`_drop`, or by the caller: a
        loader whose iteration is dropped before its first batch): nothing drawn ahead is left to put back or check."""
        self._saved = {}
        self._global, self._expected = None, {}

    def drop(self) -> None:
        """Let go of a carried iterator (fit ends, a new loader is built)."""
        carry, self._carry = self._carry, None
        if carry is not None:
            self._drop(*carry)

    def _drop(self, loader: DataLoader, inner: Iterator[Any]) -> None:
        if _batches(loader).forget_upcoming() and self._saved:
            for g, state in self._saved[min(self._saved)]:  # as before the first order drawn ahead
                g.set_state(state)
        self.forget()
        self._shutdown(loader, inner)  # a persistent loader's own iterator is reset at the next epoch instead


def _batches(loader: DataLoader) -> ResumableBatchSampler:
    """The batch sampler of a loader :class:`Seamless` carries (attached, so it is one of ours)."""
    return cast(ResumableBatchSampler, loader.batch_sampler)


def draws_from_global(sampler: Any) -> bool:
    """A RandomSampler that draws its seed from the global random state (no generator of its own, or only one
    given here for an order drawn ahead)."""
    if not isinstance(sampler, RandomSampler) or hasattr(sampler, "_dltune_seeded"):
        return False
    return sampler.generator is None or hasattr(sampler, "_dltune_global")
