set -euo pipefail
# 1. An uncased WordPiece tokenizer (BERT's [CLS] A [SEP] template, ## continuations)
raylm tokenizer train --type wordpiece --lowercase --vocab_size 1000 corpus/ -o bert-tok
# 2. A tiny BERT from scratch with masked LM (a BERT's default objective)
raylm train --model_type bert --tokenizer_name bert-tok --train_file corpus/ \
    --config_overrides "num_hidden_layers=2,hidden_size=32,num_attention_heads=2,intermediate_size=64,max_position_embeddings=64" \
    --max_seq_length 32 --max_steps 10 --learning_rate 1e-3 --num_workers 2 \
    --output_dir bert-pretrained
# 3. Fine-tune it on one play, one sample per line
raylm train --model_name_or_path bert-pretrained --train_file corpus/macbeth.txt \
    --line_by_line --max_seq_length 32 --max_steps 5 --num_workers 2 --output_dir bert-tuned
# 4. Use it
python - <<'PY'
import raylm  # noqa: F401  (first: lets torchvision import beside a CPU-only torch)
from transformers import pipeline
print(pipeline("fill-mask", model="bert-tuned")("to be or not to [MASK]."))
PY
