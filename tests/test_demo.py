"""``dltune demo`` without TensorBoard: Lightning's CSV logger and one line on how to get TensorBoard."""

import csv

import pytest

from lightning_dltune import _imports
from lightning_dltune.tools.demo import run_demo


@pytest.mark.picture  # the demo's picture is part of what it hands over
def test_the_demo_falls_back_to_csv_without_tensorboard(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_imports, "_TENSORBOARD_AVAILABLE", False)  # stands in for a machine without tensorboard
    result = run_demo(tmp_path, quick=True, epochs=1)  # one epoch: the fallback, not the tuning, is under test

    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "TensorBoard" in line or "tensorboard" in line]
    assert len(said) == 1 and "logging to CSV" in said[0] and "pip install -U tensorboard" in said[0], said
    assert "[view]" in said[0]
    log_dir = result["log_dir"]
    assert log_dir == tmp_path / "csv" / "version_0" and not (tmp_path / "tb").exists()
    with open(log_dir / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert rows and any(row.get("dltune/stall_frac") for row in rows)
    assert (log_dir / "dltune_report.json").exists() and result["plot"] == log_dir / "dltune_report.png"
    assert f"Metrics (CSV): {log_dir / 'metrics.csv'}" in out
