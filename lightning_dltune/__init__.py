"""lightning-dltune: measure DataLoader stalls inside a Lightning run and tune the loader online."""

from lightning_dltune._version import __version__
from lightning_dltune._warn import DLTuneWarning
from lightning_dltune.callback import DataLoaderTuner
from lightning_dltune.measurement.gpu import GpuStats, GpuTimeline
from lightning_dltune.measurement.measure import StepTimer, WindowStats
from lightning_dltune.mixin import TunableDataModuleMixin
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.tuning.diagnose import diagnose
from lightning_dltune.tuning.model import Budget, Decision, Policy, Trial
from lightning_dltune.tuning.rules import decide
from lightning_dltune.tuning.state import Phase, TuningState

__all__ = [
    "Budget",
    "DLTuneWarning",
    "DataLoaderTuner",
    "Decision",
    "GpuStats",
    "GpuTimeline",
    "LoaderSettings",
    "Phase",
    "Policy",
    "StepTimer",
    "Trial",
    "TunableDataModuleMixin",
    "TuningState",
    "WindowStats",
    "__version__",
    "decide",
    "diagnose",
]
