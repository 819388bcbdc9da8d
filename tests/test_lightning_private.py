"""Fails loudly when a Lightning release moves a private attribute that lightning_dltune relies on."""

import inspect
from functools import reduce

import lightning.pytorch as pl
import pytest
from lightning.fabric.utilities import data as fabric_data
from torch.utils.data import DataLoader

from lightning_dltune import _lightning


@pytest.mark.parametrize(("path", "attr"), _lightning.PRIVATE_ATTRIBUTES)
def test_private_attribute_exists(path, attr):
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    owner = reduce(getattr, path.split("."), trainer)
    assert hasattr(owner, attr), (
        f"lightning {pl.__version__} has no `{path}.{attr}`: update lightning_dltune/_lightning.py "
        "(see ../shared/LIGHTNING_NOTES.md) and the tested range in pyproject.toml"
    )


def test_rebuild_helpers_keep_their_signatures():
    params = inspect.signature(fabric_data._get_dataloader_init_args_and_kwargs).parameters
    assert list(params)[:2] == ["dataloader", "sampler"]
    assert "explicit_cls" in inspect.signature(fabric_data._reinstantiate_wrapped_cls).parameters


def test_fetcher_calls_the_profiler_hooks_around_next():
    from lightning.pytorch.loops.fetchers import _DataFetcher

    src = inspect.getsource(_DataFetcher.__next__)
    assert "self._start_profiler()" in src and "self._stop_profiler()" in src


def test_combined_loader_reset_shuts_workers_down():
    from lightning.pytorch.utilities import combined_loader

    assert "_shutdown_workers" in inspect.getsource(combined_loader._shutdown_workers_and_reset_iterator)


def test_recorded_dataloader_arguments_are_where_the_rebuild_reads_them():
    from lightning.fabric.utilities.data import _replace_dunder_methods

    with _replace_dunder_methods(DataLoader, "dataset"):
        dl = DataLoader(list(range(8)), 4, True)
    assert getattr(dl, _lightning._SAVED_ARGS) == (list(range(8)), 4, True)
    assert getattr(dl, _lightning._SAVED_ARG_NAMES) == ("dataset", "batch_size", "shuffle")
    assert isinstance(getattr(dl, _lightning._SAVED_KWARGS), dict)


def test_torch_dataloader_internals_used_for_switching_exist():
    from torch.utils.data._utils import signal_handling

    dl = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True)
    it = iter(dl)
    next(it)
    try:
        assert dl._iterator is it
        for name in ("_workers", "_shutdown_workers", "_worker_pids_set"):
            assert hasattr(it, name), f"torch moved DataLoader iterator attribute `{name}`: update _lightning.py"
        assert callable(signal_handling._remove_worker_pids)
        assert _lightning.worker_died(it, wait_s=0) is False
        _lightning.detach_from_sigchld(it)
        assert it._worker_pids_set is False
    finally:
        _lightning.shutdown_workers(dl)
