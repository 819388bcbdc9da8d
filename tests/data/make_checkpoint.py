"""Writes ``tuner-0.1.0-mid-epoch.ckpt``: a real Lightning checkpoint of a tuned fit stopped at step 25 of a
60-batch epoch that stalls (5 ms a sample, 20 ms a step), with ``DataLoaderTuner()``'s state as this release writes
it. ``tests/test_resume.py`` resumes from it, so a later change to the tuner's state must still load what 0.1.0
wrote. Run it only to add a file for a new release (``python tests/data/make_checkpoint.py``), never to replace a
committed one."""

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]  # tests/ and the repository

from test_resume import indices_of  # noqa: E402

from lightning_dltune import DataLoaderTuner, __version__  # noqa: E402

if __name__ == "__main__":
    target = HERE / f"tuner-{__version__}-mid-epoch.ckpt"
    if target.exists():
        sys.exit(f"{target} exists: a committed checkpoint is never rewritten")
    with tempfile.TemporaryDirectory() as tmp:
        # cache=False: the checkpoint must hold what this fit measured, not a start from an earlier run's cache entry
        # (a resume with the default cache: tests/test_loader_libraries.py)
        tuner = DataLoaderTuner(cache=False)
        indices_of(Path(tmp), tuner, latency_ms=5.0, every_n_steps=25, max_steps=25)
        shutil.copy(Path(tmp) / "ckpt" / "epoch=0-step=25.ckpt", target)
    print(target, target.stat().st_size, "bytes")
