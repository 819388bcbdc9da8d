"""``TunableDataModuleMixin``: a DataModule keeps its loader settings as attributes the tuner can change."""

from __future__ import annotations

from typing import Any

from lightning_dltune.settings import LoaderSettings

_FIELDS = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")
_STATE_KEY = "dltune_loader_settings"


class TunableDataModuleMixin:
    """Mix into a ``LightningDataModule`` and build the train loader with ``**self.loader_kwargs``.

    The settings live in the attributes ``num_workers``, ``prefetch_factor``, ``pin_memory`` and
    ``persistent_workers``, so a DataModule that already sets ``self.num_workers`` keeps working. A
    :class:`~lightning_dltune.DataLoaderTuner` writes the tuned values there before each reload, and the
    DataModule's ``state_dict`` carries them into checkpoints.

    Example::

        class MyData(TunableDataModuleMixin, L.LightningDataModule):
            def train_dataloader(self):
                return DataLoader(self.train_set, batch_size=64, shuffle=True, **self.loader_kwargs)
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
        for name in _FIELDS:
            setattr(self, name, getattr(settings, name))

    @property
    def loader_kwargs(self) -> dict[str, Any]:
        """``num_workers``, ``prefetch_factor``, ``pin_memory``, ``persistent_workers`` for ``DataLoader``."""
        return self.loader_settings.to_loader_kwargs()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = dict(super().state_dict())  # type: ignore[misc]
        state[_STATE_KEY] = self.loader_settings.to_loader_kwargs()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        saved = state.pop(_STATE_KEY, None)
        if saved is not None:
            self.loader_settings = LoaderSettings.from_dict(saved)
        super().load_state_dict(state)  # type: ignore[misc]
