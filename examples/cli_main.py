"""Way in #3: LightningCLI with the tuner in the YAML config.

python examples/cli_main.py fit --config examples/cli_config.yaml
python examples/cli_main.py fit --help     # every DataLoaderTuner argument, typed and documented
"""

from lightning.pytorch.cli import LightningCLI

from lightning_dltune.tools.synthetic import SimulatedModel, SyntheticDataModule


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    return LightningCLI(SimulatedModel, SyntheticDataModule, args=args, run=run, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
