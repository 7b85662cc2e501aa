# Train from dataset objects instead of files: a Hugging Face datasets.Dataset of lines
# for training, a Ray Dataset (read_text gives a "text" column) for evaluation.
from pathlib import Path

import ray
from datasets import Dataset

from raylm import TrainConfig, train

lines = [line for path in sorted(Path("corpus").glob("*.txt")) if path.name != "macbeth.txt"
         for line in path.read_text().splitlines() if line.strip()]
train_ds = Dataset.from_dict({"text": lines})
# (an absolute path: Ray Data's tasks may run in another working directory or node)
eval_ds = ray.data.read_text(str(Path("corpus/macbeth.txt").resolve()))

result = train(TrainConfig(model_type="gpt2",
                           config_overrides="n_layer=2,n_embd=32,n_head=2,n_positions=64",
                           block_size=64, max_steps=10, num_workers=2,
                           output_dir="runs/from-datasets"),
               train_dataset=train_ds, eval_dataset=eval_ds)
print(result.output_dir, result.metrics["eval_loss"])
