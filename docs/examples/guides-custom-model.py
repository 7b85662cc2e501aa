# A language model of plain torch modules, trained by raylm over a 2-stage pipeline.
import torch
from safetensors.torch import load_file
from torch import nn

from raylm import TrainConfig, train


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, h):  # a residual MLP over the running mean of the tokens so far
        mixed = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, device=h.device)[:, None]
        return h + self.down(nn.functional.gelu(self.up(self.norm(mixed))))


class MyLM(nn.Module):
    def __init__(self, vocab=4096, dim=32, layers=4):  # 4096: the built-in tokenizer's
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):  # [batch, seq] ids -> [batch, seq, vocab] logits
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


# pp=2 (1F1B) needs at least 2 micro-batches per step: gradient_accumulation_steps=2
result = train(TrainConfig(train_file=["corpus/"], block_size=64, max_steps=10,
                           per_device_train_batch_size=4, gradient_accumulation_steps=2,
                           num_workers=2, pp=2, output_dir="my-lm"), model_init=MyLM)
print(result.metrics["eval_loss"])

model = MyLM()
model.load_state_dict(load_file("my-lm/model.safetensors"))
