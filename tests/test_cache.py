import json

import pytest

from lightning_dltune import DataLoaderTuner, DLTuneWarning
from lightning_dltune.cache import CACHE_FORMAT, TuningCache, cache_key, default_cache_path
from lightning_dltune.settings import LoaderSettings
from lightning_dltune.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset

from helpers import make_trainer

FIELDS = {"cpus": 2.0, "dataset": "x.Y", "dataset_len": 10, "batch_size": 4, "version": "0.1.0"}


def test_round_trip_and_key_mismatch(tmp_path):
    cache = TuningCache(tmp_path / "c.json")
    assert cache.get(FIELDS) is None
    cache.put(FIELDS, LoaderSettings.normalized(6, 4), {"samples_per_s": 100.0})
    settings, entry = cache.get(FIELDS)
    assert settings == LoaderSettings.normalized(6, 4) and entry["samples_per_s"] == 100.0
    assert cache.get({**FIELDS, "batch_size": 8}) is None  # another key does not apply
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["format"] == CACHE_FORMAT and cache_key(FIELDS) in data["entries"]
    assert not list(tmp_path.glob(".c.json.*"))  # the atomic write left no temporary file


@pytest.mark.parametrize("content", ["{not json", '{"some": "other tool"}', "[]"])
def test_corrupt_or_foreign_file_is_ignored_with_a_warning_and_replaced(tmp_path, content):
    path = tmp_path / "c.json"
    path.write_text(content)
    cache = TuningCache(path)
    with pytest.warns(DLTuneWarning, match="not a lightning-dltune cache"):
        assert cache.get(FIELDS) is None
    cache.put(FIELDS, LoaderSettings.normalized(2))
    assert cache.get(FIELDS)[0].num_workers == 2


def test_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DLTUNE_CACHE", str(tmp_path / "mine.json"))
    assert default_cache_path() == tmp_path / "mine.json"
    monkeypatch.delenv("DLTUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_path() == tmp_path / "lightning-dltune" / "cache.json"


def fit(tmp_path, tuner, epochs=3):
    dm = SyntheticDataModule(SyntheticDataset(length=192, latency_ms=10.0), batch_size=16, num_workers=0)
    make_trainer(tmp_path, [tuner], max_epochs=epochs, logger=False).fit(SimulatedModel(step_ms=20), datamodule=dm)
    return tuner


def test_second_run_starts_from_the_cached_settings_and_only_verifies_them(tmp_path):
    first = fit(tmp_path / "1", DataLoaderTuner(cache=tmp_path / "c.json"))
    # settled, or held on a config that beat the start (the last epoch is too short to pay for another switch)
    assert first.phase in ("settled", "held") and first.best_settings["num_workers"] > 0 and not first.cache_hit

    second = fit(tmp_path / "2", DataLoaderTuner(cache=tmp_path / "c.json"), epochs=2)
    assert second.cache_hit
    assert second.trials[0].settings.to_loader_kwargs() == first.best_settings  # from its first epoch
    assert len(second.trials) == 1 and "cached settings verified" in second.trials[0].decision
    assert second.best_settings == first.best_settings


def test_cache_can_be_disabled(tmp_path):
    tuner = fit(tmp_path, DataLoaderTuner(cache=False), epochs=1)
    assert not tuner.cache_hit and not (tmp_path / "dltune_cache.json").exists()


def test_a_run_too_short_to_tune_does_not_teach_the_cache_its_starting_config(tmp_path):
    first = fit(tmp_path / "1", DataLoaderTuner(cache=tmp_path / "c.json"), epochs=1)
    assert first.phase == "held" and first.best_settings["num_workers"] == 0
    assert "a longer or resumed run goes on to workers=" in first.diagnosis
    second = fit(tmp_path / "2", DataLoaderTuner(cache=tmp_path / "c.json"), epochs=3)
    assert not second.cache_hit and second.best_settings["num_workers"] > 0
