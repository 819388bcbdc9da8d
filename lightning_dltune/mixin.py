"""``TunableDataModuleMixin``: a DataModule keeps its loader settings as attributes the tuner can change."""

from __future__ import annotations

from typing import Any

from lightning_dltune.settings import LoaderSettings

_FIELDS = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")
_STATE_KEY = "dltune_loader_settings"
_LOOPS_KEY = "dltune_loop_settings"


class TunableDataModuleMixin:
    """Mix into a ``LightningDataModule`` and build the train loader with ``**self.loader_kwargs``.

    The settings live in the attributes ``num_workers``, ``prefetch_factor``, ``pin_memory`` and
    ``persistent_workers``, so a DataModule that already sets ``self.num_workers`` keeps working. A
    :class:`~lightning_dltune.DataLoaderTuner` writes the tuned values there before each reload, and the
    DataModule's ``state_dict`` carries them into checkpoints.

    The validation, test and predict loaders take :meth:`loader_kwargs_for` (``"val"``, ``"test"``, ``"predict"``):
    the tuner's settings for that loop once it chose them, checkpointed with the DataModule too.

    Example::

        class MyData(TunableDataModuleMixin, L.LightningDataModule):
            def train_dataloader(self):
                return DataLoader(self.train_set, batch_size=64, shuffle=True, **self.loader_kwargs)

            def val_dataloader(self):
                return DataLoader(self.val_set, batch_size=64, **self.loader_kwargs_for("val"))
    """

    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    persistent_workers: bool

    @property
    def loader_settings(self) -> LoaderSettings:
        """The current settings, made consistent (``prefetch_factor=None`` with 0 workers)."""
        return LoaderSettings.normalized(
            getattr(self, "num_workers", 0),
            getattr(self, "prefetch_factor", None),
            getattr(self, "pin_memory", False),
            getattr(self, "persistent_workers", False),
        )

    @loader_settings.setter
    def loader_settings(self, settings: LoaderSettings) -> None:
        if "_dltune_given" not in self.__dict__:  # what the DataModule was given, before the tuner's first write
            self._dltune_given = self.loader_settings
        for name in _FIELDS:
            setattr(self, name, getattr(settings, name))

    def loader_kwargs_for(self, loop: str) -> dict[str, Any]:
        """``DataLoader`` settings for ``loop``'s loader: ``"train"`` gives :attr:`loader_kwargs`; ``"val"``,
        ``"test"`` or ``"predict"`` the tuner's settings for that loop once it chose them, else the settings this
        DataModule was given (the train loader's tuning does not reach the other loaders)."""
        if loop == "train":
            return self.loader_kwargs
        chosen = self.__dict__.get("_dltune_loops", {}).get(loop)
        if chosen is not None:
            return LoaderSettings.from_dict(chosen).to_loader_kwargs()
        return self.__dict__.get("_dltune_given", self.loader_settings).to_loader_kwargs()

    def set_loop_settings(self, loop: str, settings: LoaderSettings) -> None:
        """Keep the tuner's ``settings`` for ``loop``'s loader (see :meth:`loader_kwargs_for`)."""
        self.__dict__.setdefault("_dltune_loops", {})[loop] = settings.to_loader_kwargs()

    @property
    def loader_kwargs(self) -> dict[str, Any]:
        """``num_workers``, ``prefetch_factor``, ``pin_memory``, ``persistent_workers`` for ``DataLoader``."""
        return self.loader_settings.to_loader_kwargs()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = dict(super().state_dict())  # type: ignore[misc]
        state[_STATE_KEY] = self.loader_settings.to_loader_kwargs()
        loops = self.__dict__.get("_dltune_loops")
        if loops:
            state[_LOOPS_KEY] = dict(loops)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        saved = state.pop(_STATE_KEY, None)
        if saved is not None:
            self.loader_settings = LoaderSettings.from_dict(saved)
        loops = state.pop(_LOOPS_KEY, None)
        if isinstance(loops, dict):
            for loop, settings in loops.items():
                self.set_loop_settings(loop, LoaderSettings.from_dict(settings))
        super().load_state_dict(state)  # type: ignore[misc]
