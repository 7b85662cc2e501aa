set -euo pipefail
# 0. A small base model to adapt (any saved causal LM or Hub id does)
raylm tokenizer train --vocab_size 1000 corpus/ -o my-gpt2
python - <<'PY'
import raylm  # noqa: F401  (first: lets torchvision import beside a CPU-only torch)
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
tok = AutoTokenizer.from_pretrained("my-gpt2")
config = GPT2Config(vocab_size=len(tok), n_layer=2, n_embd=32, n_head=2, n_positions=64,
                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
GPT2LMHeadModel(config).save_pretrained("my-gpt2")
PY
# 1. LoRA adapters on attention and MLP, over 2 tensor-parallel ranks, merged at the end
raylm train --model_name_or_path my-gpt2 --train_file corpus/ --use_peft \
    --lora_target_modules c_attn c_proj c_fc --lora_rank 16 --merge_lora --tp 2 \
    --num_workers 2 --block_size 64 --max_steps 10 --learning_rate 1e-3 \
    --output_dir my-gpt2-lora
# 2. Load the adapter on its base, or the merged model with plain transformers
python - <<'PY'
import raylm  # noqa: F401
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM
adapted = AutoPeftModelForCausalLM.from_pretrained("my-gpt2-lora")
print(adapted.peft_config["default"].target_modules)
merged = AutoModelForCausalLM.from_pretrained("my-gpt2-lora/merged")
print(type(merged).__name__, sum(p.numel() for p in merged.parameters()))
PY
