"""Switching the train loader inside an epoch without losing or repeating a sample.

* :class:`ResumableBatchSampler` is a ``BatchSampler`` that fixes the epoch's batches when the epoch begins
  (one draw from the sampler, exactly as a plain ``BatchSampler`` would make) and can start a later iterator
  at batch ``k`` of that same order. Being a ``BatchSampler`` subclass, Lightning can still inject its
  ``DistributedSampler`` into it.
* :class:`GuardedIterator` wraps the loader iterator the training loop pulls from. Between two fetches it
  can replace the loader (new settings, same batch sampler, resumed at the number of batches the loop has
  consumed), and when a worker process dies it rebuilds with a fallback config and fetches the same batch
  again. Whatever the old workers had prefetched is dropped, never delivered.

The iterator of a replacement loader draws its workers' base seed from a copy of the global random state
(:func:`apart_from_global`), so the global random state, and with it every later epoch's order, is the same as in a
run that never switched.
"""

from __future__ import annotations

import dataclasses
import pickle
from array import array
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch
from torch.utils.data import BatchSampler


class Iteration:
    """Where one iteration of a :class:`ResumableBatchSampler` is: ``next``, the batch of epoch ``epoch_no`` it
    yields next (a loader's workers are handed batches ahead of the loop: everything before ``next`` is in
    flight or delivered); ``stop``, where it ends early (``None``: at the epoch's end)."""

    __slots__ = ("epoch_no", "next", "stop")

    def __init__(self) -> None:
        self.epoch_no, self.next = -1, 0
        self.stop: int | None = None


def _no_draw(ahead: int) -> None:
    """The hook before each draw of a sampler nobody carries on (see :meth:`ResumableBatchSampler.carry_on`)."""


def _goes_on(ahead: int) -> bool:
    return True


class ResumableBatchSampler(BatchSampler):
    """A ``BatchSampler`` whose current epoch can be resumed at any batch.

    ``__iter__`` starts a new epoch (drawing the order from ``sampler``) unless :meth:`resume_at` was called,
    in which case it yields the rest of the current epoch from that batch on. The order is kept as one flat
    ``array('q')`` of indices: 8 bytes per sample.
    """

    def __init__(
        self,
        sampler: Any,
        batch_size: int,
        drop_last: bool,
        resume_epoch: tuple[int, int] | None = None,
        exhaust: bool = False,
    ) -> None:
        super().__init__(sampler, batch_size, drop_last)
        # whether each epoch's draw goes on to the sampler's end, as the user's loader does when it has workers (their
        # prefetch asks past the last batch): a RandomSampler with a generator then draws one more permutation, and
        # every later epoch's order depends on that draw. A constructor argument, like `resume_epoch`
        self.exhaust = exhaust
        self._order: array | None = None
        self._resume: int | None = None
        # (epoch, batch): the first iteration draws epoch `epoch`'s order from an epoch-seeded sampler (a
        # DistributedSampler: seed and epoch fix it) and starts at `batch`. A constructor argument, so that it
        # survives Lightning rebuilding this batch sampler around the DistributedSampler it injects.
        self._resume_epoch = resume_epoch
        self.offset = 0  # the batch of the epoch the latest iteration starts at
        # seamless epochs (see `carry_on`): an iteration goes on into the next epochs' batches; their orders are
        # drawn as the workers ask for them and kept, by epoch number, until their epoch begins
        self.seamless = False
        self._before_draw: Callable[[int], None] = _no_draw
        self._goes_on: Callable[[int], bool] = _goes_on  # whether the fit trains past epoch `ahead`
        self._epoch_no = 0  # the number of the epoch `_order` belongs to (counted by this sampler)
        self._began_epoch = False  # the latest iteration began epoch `_epoch_no` (not a resume of it)
        self._upcoming: dict[int, array] = {}
        self.live = Iteration()  # the latest iteration: how far it has yielded, where it is cut (see `cut`)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``pickle``, ``copy.deepcopy``, ``torch.save`` of a trainer) keeps the epoch's order and position
        but not the tuner's hooks: it iterates one epoch at a time, as a plain ``BatchSampler`` does."""
        state = dict(self.__dict__)
        state.update(seamless=False, _before_draw=_no_draw, _goes_on=_goes_on)
        return state

    def __iter__(self) -> Iterator[list[int]]:
        # known as soon as the iterator is asked for; the resume itself is taken when the first batch is drawn,
        # since a DataLoader iterator may ask twice before drawing (PyTorch's workers reset once more on start)
        if self._resume_epoch is not None:
            self.offset = self._resume_epoch[1]
        else:
            self.offset = self._resume if self._resume is not None and self._order is not None else 0
        self.live = Iteration()
        return self._batches(self.live)

    def _batches(self, it: Iteration) -> Iterator[list[int]]:
        start, self._resume = self._resume, None
        self._began_epoch = False  # (see redraw_epoch)
        if self._resume_epoch is not None:  # a new epoch's order, drawn for that epoch, resumed part-way
            (epoch, start), self._resume_epoch = self._resume_epoch, None
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(epoch)
            self._order = self._draw()
        elif start is None or self._order is None:  # a new epoch from its start
            start = 0
            self._begin_next_epoch()
            self._began_epoch = True
        epoch_no, order = self._epoch_no, self._order
        assert order is not None  # drawn above, or kept from the epoch being resumed
        n = len(self)
        bs = self.batch_size
        while True:
            it.epoch_no, it.next = epoch_no, start
            for b in range(start, n):
                if it.stop is not None and b >= it.stop:
                    return
                it.next = b + 1
                yield order[b * bs : (b + 1) * bs].tolist()
            if not self.seamless or it.stop is not None or not self._goes_on(epoch_no - self._epoch_no):
                return  # nothing loads past the fit's last batch: the workers would only be stopped mid-batch
            # the next epoch's first batches, while this one's last are consumed: the workers never run dry
            epoch_no, start = epoch_no + 1, 0
            order = self._order_for(epoch_no)

    def cut(self, it: Iteration, at: int) -> bool:
        """End iteration ``it`` at batch ``at`` of the current epoch (it yields nothing from there on), so that
        another iteration resumed at ``at`` takes over. False when ``it`` has already yielded beyond ``at`` or
        left the current epoch."""
        if it.epoch_no != self._epoch_no or it.next > at or not 0 <= at <= len(self):
            return False
        it.stop = at
        return True

    def _order_for(self, epoch_no: int) -> array:
        """Epoch ``epoch_no``'s order: drawn once (the first iteration to reach it draws it), kept until used."""
        if epoch_no not in self._upcoming:
            self._before_draw(epoch_no - self._epoch_no)
            self._upcoming[epoch_no] = self._draw()
        return self._upcoming[epoch_no]

    def _begin_next_epoch(self) -> None:
        self._epoch_no += 1
        if self._epoch_no in self._upcoming:
            self._order = self._upcoming.pop(self._epoch_no)
        else:
            self._before_draw(0)
            self._order = self._draw()
        self._upcoming = {k: v for k, v in self._upcoming.items() if k > self._epoch_no}

    def carry_on(
        self,
        before_draw: Callable[[int], None],
        seamless: bool = True,
        goes_on: Callable[[int], bool] = _goes_on,
    ) -> None:
        """Seamless epochs: every iteration goes on into the next epochs' batches, so the workers load epoch
        e+1's first batches while epoch e's last ones are consumed. ``before_draw(ahead)`` is called before each
        order is drawn, ``ahead`` epochs after the current one (0: the current one), to make the draw exactly
        what it would be at that epoch's start (the sampler's epoch, a generator's state). ``seamless=False`` keeps
        only the hook (iterations end with their epoch). ``goes_on(ahead)``, asked as an iteration reaches the end of
        the epoch ``ahead`` epochs after the current one, says whether training goes on past it (the fit's last
        epoch: False, and the iteration ends there)."""
        # set past Lightning's record of attribute changes (a loader built while it records is built again around
        # the DistributedSampler it injects, and the changes replayed): the hook holds this sampler's own sampler
        object.__setattr__(self, "seamless", seamless)
        object.__setattr__(self, "_before_draw", before_draw)
        object.__setattr__(self, "_goes_on", goes_on)

    def advance(self) -> bool:
        """The next epoch begins on an iteration carried over from the last one: its order becomes the current
        one, and offsets count from its start. False when that iteration had not reached it yet."""
        if self._epoch_no + 1 not in self._upcoming:
            return False
        self._begin_next_epoch()
        self.offset = 0
        return True

    def redraw_epoch(self) -> None:
        """The latest iteration is dropped before it yielded a batch to training (an iterator reset before its
        first batch): where it began an epoch, the next ``__iter__`` begins that epoch again, drawing its order
        then; the orders drawn ahead are forgotten."""
        if self._began_epoch:
            self._epoch_no -= 1
            self._order, self._began_epoch = None, False
        self.forget_upcoming()

    def forget_upcoming(self) -> bool:
        """Drop the orders drawn ahead (no iteration will use them); True when there were any."""
        drawn, self._upcoming = bool(self._upcoming), {}
        return drawn

    def _draw(self) -> array:
        # exactly the batches an epoch consumes; past them only with `exhaust`: a RandomSampler with a generator draws
        # one more permutation when it is iterated past its end, which a loader without workers (it stops at the
        # epoch's length) never does, and one with workers always does, however many batches it has in flight
        order = array("q")
        batches = super().__iter__()
        for batch in islice(batches, len(self)):
            order.extend(batch)
        if self.exhaust:
            next(batches, None)
        return order

    def resume_at(self, batch: int) -> None:
        """The next ``__iter__`` continues the current epoch at ``batch`` (0-based) instead of starting anew."""
        if self._order is None:
            raise RuntimeError("`resume_at` needs an epoch in progress: iterate the sampler first.")
        if not 0 <= batch <= len(self):
            raise ValueError(f"`batch` must be in [0, {len(self)}], got {batch}.")
        self._resume = batch

    def resume_order(self, order: list[int], batch: int) -> None:
        """Continue an epoch whose order was saved (``epoch_order``) at ``batch``: the next ``__iter__`` yields
        the rest of it."""
        self._order = array("q", order)
        self.resume_at(batch)

    @property
    def epoch_order(self) -> list[int]:
        """Every sample index of the current epoch, in order (empty before the first epoch)."""
        return [] if self._order is None else self._order.tolist()


class RecordedBatches(Iterator[list[int]]):
    """The batches a user's own loader (a plain ``BatchSampler``) hands its running iterator, recorded, so that a
    switch inside the epoch can go on from them: :meth:`order` gives the epoch's whole order (what was handed, and
    the rest drawn then, from the same iteration, as that loader would have drawn it), :meth:`cut` ends the
    iteration early, as :meth:`ResumableBatchSampler.cut` does.

    Args:
        batches: the running iteration of the batch sampler (the iterator's own, see
            ``_lightning.record_batches``).
        length: the epoch's batches (``len`` of the batch sampler). The rest is drawn up to it, not past it, as a
            loader without workers draws (the only one recorded: see ``_lightning.record_batches``).
    """

    def __init__(self, batches: Iterator[list[int]], length: int) -> None:
        self._batches, self.length = batches, length
        self.handed: list[list[int]] = []
        self._ahead: list[list[int]] = []  # drawn for `order`, not handed yet
        self._drained = False
        self.stop: int | None = None

    def __next__(self) -> list[int]:
        if self.stop is not None and len(self.handed) >= self.stop:
            raise StopIteration
        batch = self._ahead.pop(0) if self._ahead else next(self._batches)
        self.handed.append(batch)
        return batch

    @property
    def next(self) -> int:
        """The batch of the epoch handed out next (everything before it is in flight or delivered)."""
        return len(self.handed)

    def cut(self, at: int) -> bool:
        """Hand out nothing from batch ``at`` on; False when batch ``at`` was handed out already."""
        if len(self.handed) > at or not 0 <= at <= self.length:
            return False
        self.stop = at
        return True

    def order(self) -> list[int]:
        """Every sample index of the epoch, in order: the batches handed out, then the rest of the epoch, drawn now
        from the same iteration (and kept, to be handed out from here too)."""
        if not self._drained:
            self._drained = True
            self._ahead.extend(islice(self._batches, max(0, self.length - len(self.handed) - len(self._ahead))))
        return [i for batch in (*self.handed, *self._ahead) for i in batch]


def is_worker_death(error: BaseException, worker_dead: bool = False) -> bool:
    """True for PyTorch's "a worker process died" errors (killed by a signal, OOM, bus error), and for the
    broken-pipe errors a dead worker leaves behind when it dies holding a batch's shared memory
    (``worker_dead`` says whether one of the loader's workers is in fact dead). A dataset that raises is not
    a worker death: it would fail the same way with any settings."""
    text = str(error)
    if isinstance(error, RuntimeError) and "DataLoader worker" in text:
        return "exited unexpectedly" in text or "killed by signal" in text
    return worker_dead and isinstance(error, (ConnectionError, EOFError))


def error_summary(error: BaseException) -> str:
    """``error`` in a line: where its message holds a worker's traceback, that traceback's own error line (``ValueError:
    ...``, of the error's type, whatever lines follow it); else the message's last line, or the type's name."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    own = f"{type(error).__name__}: "
    raised = [line for line in lines[1:] if line.startswith(own)]
    if raised:
        return raised[-1]
    return lines[-1] if lines else type(error).__name__


@dataclass(frozen=True)
class GuardHooks:
    """What a :class:`GuardedIterator` asks its owner (the loader switcher), by name.

    Attributes:
        replace: ``replace(loader) -> new_loader | None`` is asked before every fetch; a loader it returns takes
            over at the current position, or in the background (see ``ahead``).
        on_death: ``on_death(error, loader, position) -> new_loader | None`` is asked when a worker died; ``None``
            re-raises the error.
        on_error: ``on_error(error, loader, position) -> new_loader | None`` for any other error of a fetch.
        prepare: called on every new inner iterator (to unregister worker pids from PyTorch's SIGCHLD handler).
        worker_dead: whether one of an inner iterator's worker processes has died.
        close: stops an inner iterator's workers; called on the old one before a new one starts, so two worker sets
            are never alive at once (an OOM recovery must not OOM again), except for a background start.
        ahead: ``ahead(new) -> (lead, end) | None``: start ``new`` (a loader ``replace`` returned) in the background,
            handing over ``lead`` batches after those the old loader has already been handed, and before batch
            ``end``; ``None``: take over at once. Replacements after a failure always take over at once.
        adopt: ``adopt(old, new)`` when ``new`` becomes the loader that serves (the old one is done with).
        overlap: ``overlap(new)`` when a background start of ``new`` began (the batches until the hand-over are still
            the old loader's), ``overlap(None)`` when it was abandoned before taking over.
        build: ``build(create)`` creates a new loader's iterator (starting its workers) with ``create()`` and returns
            it; the probe times it there, on the timer's clock.
        iterate: ``iterate(loader)`` is the new iterator ``create()`` makes (``iter``, or one whose workers start
            one by one, each loading as soon as it has started).
        record: ``record(loader, inner) -> RecordedBatches | None``: where ``loader`` is the user's own (its batch
            sampler a plain ``BatchSampler``), the batches its iterator ``inner`` is handed, recorded from here on.
    """

    replace: Callable[[Any], Any] = lambda loader: None
    on_death: Callable[[BaseException, Any, int], Any] = lambda error, loader, position: None
    on_error: Callable[[BaseException, Any, int], Any] = lambda error, loader, position: None
    prepare: Callable[[Iterator[Any]], None] = lambda it: None
    worker_dead: Callable[[Iterator[Any]], bool] = lambda it: False
    close: Callable[[Iterator[Any]], None] = lambda it: None
    ahead: Callable[[Any], tuple[int, int] | None] = lambda new: None
    adopt: Callable[[Any, Any], None] = lambda old, new: None
    overlap: Callable[[Any | None], None] = lambda new: None
    build: Callable[[Callable[[], Iterator[Any]]], Iterator[Any]] = lambda create: create()
    iterate: Callable[[Any], Iterator[Any]] = iter
    record: Callable[[Any, Iterator[Any]], RecordedBatches | None] = lambda loader, inner: None


class GuardedIterator(Iterator[Any]):
    """The iterator the training loop pulls train batches from, able to change loaders between fetches.

    A replacement either takes over at once (the old workers stop, the new ones start, and the loop waits for the
    new loader's first batch), or in the background: the new loader's iterator starts at a hand-over batch ``h``
    a little ahead of the loop while the old one goes on serving the batches before ``h`` (its iteration of the
    batch sampler is cut there: it is handed no batch from ``h`` on), and at ``h`` the old workers stop and the
    new iterator, started at ``h``, serves the rest. Either way every batch of the epoch is delivered once, in
    order.

    The loader it starts on is the tuner's (its batch sampler a :class:`ResumableBatchSampler`), or the user's own,
    left as the user built it until a setting changes: its iterator's batches are then recorded
    (:class:`RecordedBatches`), and a replacement is handed their order (:meth:`epoch_order`).

    Args:
        loader: the current ``DataLoader``.
        inner: the iterator of ``loader`` the loop was using.
        hooks: what it asks its owner (:class:`GuardHooks`).
    """

    def __init__(self, loader: Any, inner: Iterator[Any], hooks: GuardHooks = GuardHooks()) -> None:
        self.loader = loader
        self.inner = inner
        # batches of the epoch already delivered: where the loader's sampler started (a resumed epoch starts late)
        self.position = int(getattr(loader.batch_sampler, "offset", 0))
        self.hooks = hooks
        self.next: tuple[Any, Iterator[Any], int] | None = None  # (loader, its iterator, hand-over batch)
        self.handed_over = 0  # background starts that took over
        self.recorded = None if isinstance(loader.batch_sampler, ResumableBatchSampler) else hooks.record(loader, inner)
        hooks.prepare(inner)

    def epoch_order(self) -> list[int]:
        """Every sample index of the running epoch, in order (the user's own loader's: drawn to its end now)."""
        if self.recorded is not None:
            return self.recorded.order()
        return list(self.loader.batch_sampler.epoch_order)

    def __next__(self) -> Any:
        sampler = self.loader.batch_sampler
        if getattr(sampler, "seamless", False) and self.position >= len(sampler):  # it goes on into the next epoch
            raise StopIteration
        if self.next is not None and self.position >= self.next[2]:
            self._hand_over()
        new = self.hooks.replace(self.loader)
        if new is not None and not self._start_behind(new):
            self._switch(new)
        while True:
            try:
                batch = next(self.inner)
            except StopIteration:
                raise
            except Exception as ex:
                self.abandon()  # a recovery stops every worker first
                if is_worker_death(ex, self.hooks.worker_dead(self.inner)):
                    new = self.hooks.on_death(ex, self.loader, self.position)
                else:
                    new = self.hooks.on_error(ex, self.loader, self.position)
                if new is None:
                    raise
                self._switch(new)
                continue
            self.position += 1
            return batch

    def _start_behind(self, new: Any) -> bool:
        """Start ``new`` in the background, when ``ahead`` allows it and the old iteration can be cut ahead."""
        plan = self.hooks.ahead(new)
        sampler = self.loader.batch_sampler
        recorded = self.recorded  # None: the tuner's batch sampler, shared by the old loader and the new
        if plan is None or self.next is not None or (recorded is None and new.batch_sampler is not sampler):
            return False
        lead, end = plan
        handed = sampler.live.next if recorded is None else recorded.next
        # `lead` batches from the loop's position, and never before what the old workers were handed already
        at = min(max(handed, self.position + lead), end - 1, len(sampler) - 1)
        if at <= self.position:
            return False
        if not (sampler.cut(sampler.live, at) if recorded is None else recorded.cut(at)):
            return False
        new.batch_sampler.resume_at(at)
        inner = self._start(new)
        self.next = (new, inner, at)
        self.hooks.overlap(new)
        return True

    def _hand_over(self) -> None:
        assert self.next is not None
        new, inner, _ = self.next
        self.next = None
        self.hooks.close(self.inner)
        self.hooks.adopt(self.loader, new)
        self.loader, self.inner, self.recorded = new, inner, None
        self.handed_over += 1

    def abandon(self) -> Any:
        """Stop a background start that has not taken over (on a failure, or when the epoch ended before the
        hand-over); returns its loader, or ``None`` when there was none. The old loader's iteration stays cut:
        it must not serve past the hand-over batch (a recovery resumes at the loop's position)."""
        if self.next is None:
            return None
        new, inner, _ = self.next
        self.next = None
        self.hooks.close(inner)
        self.hooks.overlap(None)
        return new

    def _switch(self, new: Any) -> None:
        sampler = new.batch_sampler
        if not isinstance(sampler, ResumableBatchSampler):
            raise TypeError("a replacement loader must keep the ResumableBatchSampler of the epoch")
        sampler.resume_at(self.position)
        self.abandon()  # a later decision (a switch down for memory) replaces a background start
        self.hooks.close(self.inner)
        inner = self._start(new)  # adopted as it started (a worker that could not start is not counted)
        self.hooks.adopt(self.loader, new)
        self.loader, self.inner, self.recorded = new, inner, None

    def _start(self, new: Any) -> Iterator[Any]:
        # a new iterator draws its workers' base seed from the loader's generator, or without one from the global
        # state: a run that never switched makes no such draw in the middle of an epoch (with seamless epochs, the
        # next epoch's order may be drawn as the new workers are first given batches)
        inner = self.hooks.build(lambda: apart_from_global(new, lambda: self.hooks.iterate(new)))
        self.hooks.prepare(inner)
        return inner


def apart_from_global(loader: Any, create: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """``create()`` a new iterator of ``loader`` drawing its workers' base seed from a copy of the global random state:
    neither the global state nor the loader's generator (which keeps only what its sampler draws) is drawn from,
    and the seed is the one the global state would give. Under :func:`torch.random.fork_rng` the global state would
    be one draw on while the iterator is created, and an order drawn ahead then from a copy of the global state
    (``seamless``) would be drawn from the wrong one."""
    copy = torch.Generator()
    copy.set_state(torch.get_rng_state())
    generator = getattr(loader, "generator", None)
    loader.generator = copy
    try:
        return create()
    finally:
        loader.generator = generator


class ShardCheck(Iterator[Any]):
    """The first iteration of an ``IterableDataset``'s loader that the tuner gave two or more workers: before it
    serves another batch, it compares two workers' batches of the same rank (PyTorch hands the workers their turns
    in order, so with ``workers`` of them batch ``b`` is batch ``b // workers`` of worker ``b % workers``), the first
    such pair after the ``taken`` batches the loop already took (Lightning's fetcher takes one ahead). The same batch
    means the dataset does not shard itself with ``get_worker_info()`` and every worker yields all of it:
    ``on_repeat(loader, inner, taken)`` then stops ``inner`` and gives the iterator to serve instead, and none of the
    batches looked at is served. Otherwise they are served, in order, and ``inner`` goes on."""

    def __init__(
        self,
        loader: Any,
        inner: Iterator[Any],
        on_repeat: Callable[[Any, Iterator[Any], int], Iterator[Any]],
        taken: int,
        workers: int,
    ) -> None:
        self.loader, self.inner, self.taken = loader, inner, taken
        self._on_repeat = on_repeat
        first = taken + 1 if taken % workers == workers - 1 else taken  # a pair's first batch: not the last worker's
        self._look = first + 2 - taken  # batches to look at: up to the pair's second
        self._ahead: list[Any] | None = None

    def __next__(self) -> Any:
        if self._ahead is None:
            self._ahead = list(islice(self.inner, self._look))
            if len(self._ahead) == self._look and same_batch(*self._ahead[-2:]):
                self.inner, self._ahead = self._on_repeat(self.loader, self.inner, self.taken), []
        if self._ahead:
            return self._ahead.pop(0)
        return next(self.inner)


def same_batch(a: Any, b: Any) -> bool:
    """Whether two collated batches hold the same values: tensors, mappings, sequences and dataclasses of them, arrays
    that compare element by element (numpy's), or any other value. A value whose ``==`` raises or cannot be read as
    one truth is compared by its pickled bytes; one that does not pickle either cannot be told apart (``False``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, Mapping):
        return a.keys() == b.keys() and all(same_batch(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_batch(x, y) for x, y in zip(a, b, strict=True))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(same_batch(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    try:
        equal = a == b
        if isinstance(equal, bool):
            return equal
        if hasattr(equal, "all") and getattr(a, "shape", None) == getattr(b, "shape", None):
            return bool(equal.all())  # an array's elementwise answer
        return bool(equal)
    except Exception:
        pass
    try:
        return pickle.dumps(a) == pickle.dumps(b)
    except Exception:
        return False
