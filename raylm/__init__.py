"""raylm: a Ray-native, elastic trainer for Hugging Face language models.

    from raylm import TrainConfig, train
    result = train(TrainConfig(max_steps=50, num_workers=2))
    print(result.metrics, result.output_dir)
    plot_run(result.output_dir)  # output_dir/metrics.png
"""

from raylm.compat import watch_torchvision
from raylm.config import TrainConfig
from raylm.errors import ConfigError, TrainingFailed

watch_torchvision()  # (before anything imports transformers: see raylm.compat)

__version__ = "0.1.0"
__all__ = ["TrainConfig", "train", "TrainResult", "keep_ranks", "plot_run", "ConfigError",
           "TrainingFailed"]


def __getattr__(name):
    # Importing raylm stays light (the CLI's --help needs neither Ray nor torch).
    if name in ("train", "TrainResult"):
        from raylm.runtime import driver

        return getattr(driver, name)
    if name == "keep_ranks":
        from raylm.runtime.kept import keep_ranks

        return keep_ranks
    if name == "plot_run":
        from raylm.cli.plot import plot_run

        return plot_run
    raise AttributeError(name)
