set -euo pipefail
# 1. A tokenizer with T5's sentinel tokens (<extra_id_0> ... <extra_id_19>)
raylm tokenizer train --vocab_size 1000 --extra_ids 20 corpus/ -o t5-tok
# 2. A tiny T5 from scratch with span corruption (T5's default objective)
raylm train --model_type t5 --tokenizer_name t5-tok --train_file corpus/ \
    --config_overrides "num_layers=2,num_decoder_layers=2,d_model=32,d_kv=8,d_ff=64,num_heads=4" \
    --max_seq_length 32 --max_steps 10 --learning_rate 1e-3 --num_workers 2 \
    --output_dir t5-spans
# 3. The saved model is a plain seq2seq model
python - <<'PY'
import raylm  # noqa: F401  (first: lets torchvision import beside a CPU-only torch)
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
model = AutoModelForSeq2SeqLM.from_pretrained("t5-spans")
tok = AutoTokenizer.from_pretrained("t5-spans")
ids = tok("To be, or <extra_id_0> to be", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=10)[0]))
PY
