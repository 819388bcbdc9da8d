"""The optional packages, detected in one place (as Lightning does, with ``RequirementCache``).

Read the flags through this module (``_imports._MATPLOTLIB_AVAILABLE``) at the moment they matter, so that a
test can stand in for a machine without the package by setting the flag here.
"""

from __future__ import annotations

from lightning_utilities.core.imports import RequirementCache

# the `[view]` extra: the picture of a run (`dltune plot`, the PNG after `fit`) and TensorBoard's logs
_MATPLOTLIB_AVAILABLE = RequirementCache("matplotlib>=3.7")
_TENSORBOARD_AVAILABLE = RequirementCache("tensorboard>=2.12")

VIEW_EXTRA = "pip install 'lightning-dltune[view]'"
MATPLOTLIB_MISSING = (
    f"matplotlib (>=3.7) is not installed: `pip install -U matplotlib` (or the [view] extra: `{VIEW_EXTRA}`)"
)
TENSORBOARD_MISSING = (
    f"tensorboard (>=2.12) is not installed: `pip install -U tensorboard` (or the [view] extra: `{VIEW_EXTRA}`)"
)
