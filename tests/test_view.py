"""What a run shows: the series in the report, the PNG next to it, ``dltune plot``, TensorBoard's text and dashboard."""

import json
import re
import shutil
import struct

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from lightning_dltune import DataLoaderTuner, _imports
from lightning_dltune.output.plot import config_changes
from lightning_dltune.output.report import (
    NUM_WORKERS,
    PREFETCH_FACTOR,
    REPORT_VERSION,
    SAMPLES_PER_S,
    SERIES_KEYS,
    STALL_FRAC,
    WindowSeries,
    build_report,
    read_report,
)
from lightning_dltune.output.view import DASHBOARD_CHARTS, SUMMARY_TAG
from lightning_dltune.tools.cli import main
from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule, SyntheticDataset, in_memory_dataset

from helpers import make_trainer

pytestmark = pytest.mark.picture  # the picture's own tests: drawn on the default arguments

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    """(width, height) of a PNG file, after checking its signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def test_a_fit_draws_its_run_next_to_the_report_and_tensorboard_gets_the_text_and_the_dashboard(tmp_path):
    # 160 ms a batch at 0 workers against a 5 ms step, over 3 epochs of 16 steps: a switch saves seconds,
    # far more than any worker start-up (a shorter run may rightly stay at 0: the run-length rule)
    dm = SyntheticDataModule(SyntheticDataset(length=256, latency_ms=10.0), batch_size=16, num_workers=0)
    tuner = DataLoaderTuner()
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = make_trainer(tmp_path, [tuner], max_epochs=3, log_every_n_steps=2, logger=logger)
    trainer.fit(SimulatedModel(step_ms=5), datamodule=dm)

    run = tmp_path / "tb" / "version_0"
    assert tuner.report_file == run / "dltune_report.json"
    assert tuner.plot_file == run / "dltune_report.png"
    width, height = png_size(tuner.plot_file)
    assert width >= 600 and height >= 600 and tuner.plot_file.stat().st_size > 20_000

    report = json.loads(tuner.report_file.read_text())
    assert report["version"] == REPORT_VERSION == 3
    series = report["series"]
    assert set(series) == {"step", "stall_frac", "samples_per_s", "num_workers", "prefetch_factor"}  # no GPU here
    # every logging window: 16 batches an epoch, every 2 steps, and at each decision to change the config (the steps
    # before it ran on the old one: logged as its own, not mixed into the next config's first window)
    steps, cadence = series["step"], list(range(2, 3 * 16 + 1, 2))
    assert set(cadence) <= set(steps) and steps == sorted(set(steps)), steps
    configs = list(zip(series["num_workers"], series["prefetch_factor"], strict=True))
    for i in (i for i, step in enumerate(steps) if step not in cadence):
        assert configs[i] != configs[i + 1], (steps, configs)  # the point before a change
    assert series["num_workers"][0] == 0 and max(series["num_workers"]) > 0  # tuned from 0: a change to draw
    assert config_changes(series["step"], series["num_workers"], series["prefetch_factor"])

    # the series is what TensorBoard got, window by window
    events = EventAccumulator(str(run))
    events.Reload()
    for key in ("stall_frac", "samples_per_s", "num_workers"):
        logged = [(e.step, e.value) for e in events.Scalars(f"dltune/{key}")]
        assert [s for s, _ in logged] == series["step"]
        # the series rounds to 2 decimals (0.005 at most), and TensorBoard keeps float32 (a relative 2**-24: CI saw
        # 2152.385009765625 logged against 2152.38 in the series, 0.00501 apart)
        far = [(v, x) for (_, v), x in zip(logged, series[key], strict=True) if abs(v - x) > 0.005 + abs(x) * 2**-23]
        assert not far, (key, far)

    # the Text tab: the diagnosis and the summary table in a code block
    (text_tag,) = [t for t in events.Tags()["tensors"] if t.startswith(SUMMARY_TAG)]
    texts = [e.tensor_proto.string_val[0].decode() for e in events.Tensors(text_tag)]
    assert tuner.diagnosis in texts[-1]
    assert re.search(r"```\nconfig +steps +samples/s +stall", texts[-1]), texts[-1]

    # the custom-scalars dashboard: one category, each chart's tags matched exactly
    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    (category,) = layout.category
    charts = {chart.title: list(chart.multiline.tag) for chart in category.chart}
    assert category.title == "dltune" and set(charts) == set(DASHBOARD_CHARTS)
    for title, tags in DASHBOARD_CHARTS.items():
        assert all(re.fullmatch(pattern, tag) for pattern, tag in zip(charts[title], tags, strict=True)), charts
        assert not re.fullmatch(charts[title][0], tags[0] + "_spread")  # exactly: stall_frac is not its spread
    shown = {tag for tags in DASHBOARD_CHARTS.values() for tag in tags}
    for key in ("stall_frac", "gpu_stall_frac", "data_wait_ms", "step_ms", "num_workers", "prefetch_factor"):
        assert f"dltune/{key}" in shown
    assert "dltune/gpu_util_pct" in shown

    # `dltune plot` draws the same picture again from the report, by default next to it
    copy = tmp_path / "copy.json"
    shutil.copy(tuner.report_file, copy)
    assert main(["plot", str(copy)]) == 0
    assert (tmp_path / "copy.png").read_bytes() == tuner.plot_file.read_bytes()


@pytest.mark.parametrize("plot", [True, False])
def test_without_a_tensorboard_logger_the_series_is_kept_and_plot_false_draws_nothing(tmp_path, plot):
    dm = SyntheticDataModule(in_memory_dataset(256), batch_size=32, num_workers=0)
    tuner = DataLoaderTuner(plot=plot)  # the argument under test
    make_trainer(tmp_path, [tuner], max_epochs=2, log_every_n_steps=2, logger=flat_csv(tmp_path)).fit(
        SimulatedModel(step_ms=1), datamodule=dm
    )
    assert tuner.report_file == tmp_path / "dltune_report.json"
    assert json.loads(tuner.report_file.read_text())["series"]["step"] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert (tmp_path / "dltune_report.png").exists() is plot
    assert (tuner.plot_file is not None) is plot


def test_without_matplotlib_the_png_is_skipped_with_one_info_line(tmp_path, monkeypatch, lightning_log):
    monkeypatch.setattr(_imports, "_MATPLOTLIB_AVAILABLE", False)  # stands in for a machine without matplotlib
    dm = SyntheticDataModule(in_memory_dataset(128), batch_size=32, num_workers=0)
    tuner = DataLoaderTuner()
    make_trainer(tmp_path, [tuner], max_epochs=2, log_every_n_steps=2, logger=flat_csv(tmp_path)).fit(
        SimulatedModel(step_ms=1), datamodule=dm
    )
    assert tuner.report_file.exists() and tuner.plot_file is None
    assert not list(tmp_path.glob("*.png"))
    said = [r.getMessage() for r in lightning_log.records if "no picture of the run" in r.getMessage()]
    assert len(said) == 1 and "pip install -U matplotlib" in said[0] and "[view]" in said[0], said


def test_a_run_shorter_than_one_logging_window_draws_nothing_and_says_why(tmp_path, lightning_log):
    dm = SyntheticDataModule(in_memory_dataset(128), batch_size=32, num_workers=0)
    tuner = DataLoaderTuner()
    make_trainer(tmp_path, [tuner], max_epochs=1, log_every_n_steps=50, logger=flat_csv(tmp_path)).fit(
        SimulatedModel(step_ms=1), datamodule=dm
    )
    assert tuner.report["series"]["step"] == [] and tuner.plot_file is None
    said = [r.getMessage() for r in lightning_log.records if "no picture of the run" in r.getMessage()]
    assert len(said) == 1 and "no window was logged" in said[0] and "`log_every_n_steps`" in said[0], said


def flat_csv(root):
    """A logger whose directory is ``root`` itself: the report and its picture land there."""
    return CSVLogger(root, name="", version="")


def small_report(**changes):
    series = WindowSeries()
    for step, workers in [(5, 0), (10, 0), (15, 4), (20, 4)]:
        metrics = {STALL_FRAC: 0.5, SAMPLES_PER_S: 100.0, NUM_WORKERS: workers, PREFETCH_FACTOR: 2 if workers else 0}
        series.record(step, metrics)
    report = build_report(
        trials=[], start=None, settled=None, phase="settled", diagnosis="input-bound.", budget=None, series=series
    )
    report.update(changes)
    return report


V1_REPORT = {"version": 1, "phase": "settled", "diagnosis": "input-bound.", "trials": [], "settled_settings": None}


@pytest.mark.parametrize(
    ("content", "out", "message"),
    [
        (None, None, "no such file: {report}. Pass the dltune_report.json that `fit` wrote"),
        ("not json {", None, "{report} is not a dltune report (not JSON). Pass the dltune_report.json"),
        ({"rows": [], "recommended": {}}, None, "{report} is not a dltune report (no version and trials)"),
        (V1_REPORT, None, "no per-window series to draw: it was written before reports kept one (version 1)"),
        (small_report(), "{report}/x.png", "cannot write {report}"),
    ],
    ids=["missing", "not-json", "not-a-report", "version-1", "unwritable-out"],
)
def test_dltune_plot_bad_input_is_one_line_naming_the_problem_and_the_fix(tmp_path, capsys, content, out, message):
    report = tmp_path / "dltune_report.json"
    if content is not None:
        report.write_text(content if isinstance(content, str) else json.dumps(content))
    args = ["plot", str(report)] + (["--out", out.format(report=report)] if out else [])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("dltune plot: error: ") and err.count("\n") == 1, err
    assert message.format(report=report) in err and "Traceback" not in err
    assert not list(tmp_path.glob("*.png"))


def test_dltune_plot_without_matplotlib_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(_imports, "_MATPLOTLIB_AVAILABLE", False)  # stands in for a machine without matplotlib
    report = tmp_path / "dltune_report.json"
    report.write_text(json.dumps(small_report()))
    assert main(["plot", str(report)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib (>=3.7) is not installed: `pip install -U matplotlib`" in err, err
    assert "lightning-dltune[view]" in err


def test_a_version_1_report_still_reads(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(V1_REPORT))
    report = read_report(path)
    assert report["diagnosis"] == "input-bound." and report["version"] == 1
    assert report["series"] == {key: [] for key in SERIES_KEYS} and SERIES_KEYS[0] == "step"


@pytest.mark.parametrize(
    ("workers", "prefetch", "changes"),
    [
        ([0, 0, 0], [0, 0, 0], []),
        ([0, 0, 4, 4], [0, 0, 2, 2], [20]),  # the window ending at 30 (from 20) is the first on 4 workers
        ([4, 4, 4], [2, 2, 4], [20]),  # a deeper prefetch is a change too
        ([0, 8, 2, 2], [0, 2, 2, 2], [10, 20]),
        ([3], [2], []),
    ],
)
def test_config_changes_mark_the_start_of_the_first_window_on_a_new_config(workers, prefetch, changes):
    steps = [10 * (i + 1) for i in range(len(workers))]
    assert config_changes(steps, workers, prefetch) == changes


def test_a_long_run_keeps_its_series_small_and_evenly_spaced():
    series = WindowSeries(max_points=8)
    for step in range(1, 101):
        workers = 0 if step <= 50 else 4
        series.record(step, {STALL_FRAC: 0.1, SAMPLES_PER_S: 1.0, NUM_WORKERS: workers, PREFETCH_FACTOR: 0})
    steps = series.to_dict()["step"]
    assert len(steps) <= 8
    assert steps == list(range(1, 101, 16)), steps  # every 16th window, evenly spaced
    assert series.to_dict()["num_workers"][-1] == 4


def test_the_gpu_stall_is_kept_only_where_it_was_measured():
    series = WindowSeries()
    base = {STALL_FRAC: 0.1, SAMPLES_PER_S: 1.0, NUM_WORKERS: 0, PREFETCH_FACTOR: 0}
    series.record(1, base)
    assert "gpu_stall_frac" not in series.to_dict()
    series.record(2, {**base, "dltune/gpu_stall_frac": 0.25})
    assert series.to_dict()["gpu_stall_frac"] == [None, 0.25]


def test_pinned_memory_is_logged_kept_in_the_series_and_marked_as_a_config_change():
    from lightning_dltune.measurement.measure import WindowStats
    from lightning_dltune.output.report import PIN_MEMORY, WindowSeries, window_metrics
    from lightning_dltune.settings import LoaderSettings

    series = WindowSeries()
    for step, pinned in ((10, False), (20, False), (30, True), (40, True)):
        settings = LoaderSettings.normalized(4, 2, pin_memory=pinned)
        metrics = window_metrics(WindowStats(steps=1, wall_s=1.0, samples=8), None, settings)
        assert metrics[PIN_MEMORY] == float(pinned)
        series.record(step, metrics)
    columns = series.to_dict()
    assert columns["pin_memory"] == [0, 0, 1, 1]
    assert config_changes(columns["step"], columns["num_workers"], columns["prefetch_factor"]) == []
    assert config_changes(
        columns["step"], columns["num_workers"], columns["prefetch_factor"], columns["pin_memory"]
    ) == [20]
    unpinned = WindowSeries()
    unpinned.record(10, window_metrics(WindowStats(steps=1, wall_s=1.0), None, LoaderSettings()))
    assert "pin_memory" not in unpinned.to_dict()  # as in a report written before pinned memory was logged
