set -euo pipefail
# A short run that logs every 2 steps to metrics.jsonl and TensorBoard, and traces
# 2 steps with torch's profiler
raylm train --model_type gpt2 --config_overrides "n_layer=2,n_embd=32,n_head=2,n_positions=64" \
    --train_file corpus/ --block_size 64 --max_steps 10 --logging_steps 2 --num_workers 2 \
    --report_to tensorboard --profile --profile_steps 2 --output_dir runs/watched
raylm plot runs/watched                  # writes runs/watched/metrics.png
ls runs/watched/runs                     # TensorBoard: tensorboard --logdir runs/watched/runs
ls runs/watched/profile                  # rank-0.json, rank-1.json: open in Perfetto
# The last logged step, and where its time went
python - <<'PY'
import json
steps = [r for r in map(json.loads, open("runs/watched/metrics.jsonl")) if "loss" in r]
last = steps[-1]
print({k: last[k] for k in ("step", "loss", "learning_rate", "grad_norm", "tokens_per_second")})
print(last["breakdown"])
PY
