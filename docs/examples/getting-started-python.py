from raylm import TrainConfig, train
from transformers import AutoModelForCausalLM, AutoTokenizer

result = train(TrainConfig(train_file=["corpus/"], model_type="gpt2",
                           config_overrides="n_layer=2,n_embd=64,n_head=2,n_positions=128",
                           block_size=64, max_steps=10, num_workers=2,
                           output_dir="runs/gpt2-tiny"))
print(result.output_dir, result.metrics)  # eval_loss, perplexity, train_runtime, ...

# The output is a Hugging Face model directory.
model = AutoModelForCausalLM.from_pretrained(result.output_dir)
tok = AutoTokenizer.from_pretrained(result.output_dir)
ids = tok("To be, or not to be", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=20, do_sample=True)[0]))
