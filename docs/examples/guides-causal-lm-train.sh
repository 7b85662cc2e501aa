set -euo pipefail
# 1. A tiny GPT-2 from scratch on the plays in corpus/ (raylm's built-in tokenizer)
raylm train --model_type gpt2 --config_overrides "n_layer=2,n_embd=32,n_head=2,n_positions=64" \
    --train_file corpus/ --block_size 64 --per_device_train_batch_size 4 \
    --learning_rate 1e-3 --max_steps 10 --num_workers 2 --output_dir runs/gpt2-tiny
# 2. Fine-tune the saved model on one play, evaluated on another
raylm train --model_name_or_path runs/gpt2-tiny --train_file corpus/macbeth.txt \
    --validation_file corpus/julius_caesar.txt --block_size 64 \
    --max_steps 5 --num_workers 2 --output_dir runs/gpt2-tuned
# 3. Generate with plain transformers
python - <<'PY'
import raylm  # noqa: F401  (first: lets torchvision import beside a CPU-only torch)
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("runs/gpt2-tuned")
tok = AutoTokenizer.from_pretrained("runs/gpt2-tuned")
ids = tok("To be, or not to be", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=20, do_sample=True)[0]))
PY
