"""lightning-dltune: measure DataLoader stalls inside a Lightning run and tune the loader online.

The public API is what a user of the callback meets: the callback and the DataModule mixin, the warning category,
and the types of the tuner's results (``tuner.trials`` are :class:`Trial` values of :class:`LoaderSettings` and
:class:`WindowStats`; ``tuner.phase`` is a :class:`Phase`). The parts behind them (the decision, the model, the
measurement) are importable from their modules, and may change between releases."""

from lightning_dltune._version import __version__
from lightning_dltune._warn import DLTuneWarning
from lightning_dltune.callback import DataLoaderTuner
from lightning_dltune.measurement.measure import WindowStats
from lightning_dltune.mixin import TunableDataModuleMixin
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.model import Trial
from lightning_dltune.tuning.state import Phase

__all__ = [
    "DLTuneWarning",
    "DataLoaderTuner",
    "LoaderSettings",
    "Phase",
    "Trial",
    "TunableDataModuleMixin",
    "WindowStats",
    "__version__",
]
