import json
import sys
from pathlib import Path

import pytest

from lightning_dltune.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]

TARGET = """
import time
import torch
from torch.utils.data import Dataset, DataLoader

class Slow(Dataset):
    def __len__(self):
        return 1024
    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.zeros(8), i

class Broken(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        raise KeyError("no such image: 17.jpg")

def factory():
    return DataLoader(Slow(), 16, True)

not_a_loader = 42
"""


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "mydata.py"
    path.write_text(TARGET)
    yield path
    forget_module(path)


def forget_module(path):
    """``dltune bench`` imports a file under its own name (spawned workers import it again): each test's file
    is a new one of the same name, which the bench would rightly refuse as a second module of that name."""
    sys.modules.pop(path.stem, None)
    if str(path.parent.resolve()) in sys.path:
        sys.path.remove(str(path.parent.resolve()))


def test_bench_sweeps_recommends_and_writes_json_and_plot(target, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            f"{target}:factory",
            "--max-workers",
            "4",
            "--prefetch",
            "2",
            "--batches",
            "12",
            "--repeats",
            "2",
            "--step-ms",
            "5",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads((out / "bench.json").read_text())
    assert [r["num_workers"] for r in result["rows"]] == [0, 1, 2, 4]
    zero, four = result["rows"][0], result["rows"][-1]
    assert four["batches_per_s"] > 2 * zero["batches_per_s"]  # 32 ms of sleep per batch: workers overlap it
    assert zero["predicted_stall"] > 0.5
    assert result["recommended"]["num_workers"] >= 2
    assert (out / "bench.png").exists()
    assert "Recommended: num_workers=" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "TARGET must be `path/to/file.py:name` or `module:name`"),
        ("{dir}/missing.py:x", "no such file"),
        ("{target}:nothing", "has no attribute 'nothing'"),
        ("{target}:not_a_loader", "TARGET must be or give a Dataset, a DataLoader or a LightningDataModule"),
        ("{target}:Broken", "the dataset raised while loading: KeyError: 'no such image: 17.jpg'"),
        ("no_such_module_xyz:thing", "importing no_such_module_xyz failed: ModuleNotFoundError"),
    ],
)
def test_bench_user_errors_are_one_clear_line(spec, message, target, tmp_path, capsys):
    spec = spec.format(dir=tmp_path, target=target)
    assert main(["bench", spec, "--max-workers", "1", "--batches", "2", "--repeats", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dltune bench: error: ") and message in err and "Traceback" not in err


def test_lightning_cli_yaml_builds_the_tuner_and_trains(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from cli_main import main as cli_main

    from lightning_dltune import DataLoaderTuner

    config = (ROOT / "examples" / "cli_config.yaml").read_text()
    config = config.replace("dltune_runs/example_cli", str(tmp_path)).replace("max_epochs: 4", "max_epochs: 2")
    config = config.replace("length: 480", "length: 160")
    (tmp_path / "c.yaml").write_text(config)
    cli = cli_main(["fit", "--config", str(tmp_path / "c.yaml")])
    tuners = [c for c in cli.trainer.callbacks if isinstance(c, DataLoaderTuner)]
    assert len(tuners) == 1 and tuners[0].max_workers == 16
    assert tuners[0].trials and tuners[0].trials[0].settings.num_workers == 0


def test_lightning_cli_help_documents_every_tuner_argument(capsys, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    from lightning_dltune.tools.synthetic import SimulatedModel

    monkeypatch.setattr(sys, "argv", ["prog", "--trainer.callbacks.help", "lightning_dltune.DataLoaderTuner"])
    with pytest.raises(SystemExit):
        LightningCLI(SimulatedModel, run=False)
    out = capsys.readouterr().out
    for arg in ("stall_threshold", "max_trials", "max_workers", "max_prefetch", "min_steps", "observe_only"):
        assert f"--trainer.callbacks.{arg}" in out, out[-2000:]
    assert "stall fraction (data wait / wall time)" in out
    assert "(type: int | null, default: null)" in " ".join(out.split())  # max_workers is typed
    assert "--trainer.callbacks.mode {auto,epoch,in_epoch}" in out  # a Literal: the choices are listed


def test_lightning_cli_rejects_a_bad_mode_at_parse_time(capsys, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    from lightning_dltune.tools.synthetic import SimulatedModel

    args = ["prog", "--trainer.callbacks=lightning_dltune.DataLoaderTuner", "--trainer.callbacks.mode=sometimes"]
    monkeypatch.setattr(sys, "argv", args)
    with pytest.raises(SystemExit) as exit_info:
        LightningCLI(SimulatedModel, run=False)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "Expected a typing.Literal['auto', 'epoch', 'in_epoch']. Got value: sometimes" in err


def test_version_names_the_package_torch_and_lightning(capsys):
    import lightning
    import torch

    from lightning_dltune import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    versions = f"(torch {torch.__version__}, lightning {lightning.__version__})"
    assert out.startswith(f"lightning-dltune {__version__} {versions}")
