set -euo pipefail
# Tokenize while training: three plays streamed, a fourth held out for evaluation.
# The ranks take half a CPU each so that Ray Data's tasks have room beside them.
raylm train --streaming --max_steps 10 --train_file 'corpus/[cjm]*.txt' \
    --validation_file corpus/midsummer_nights_dream.txt --shuffle_buffer_size 200 \
    --model_type gpt2 --config_overrides "n_layer=2,n_embd=32,n_head=2,n_positions=64" \
    --block_size 64 --num_workers 2 --cpus_per_worker 0.5 --log_sample_ids \
    --output_dir runs/streamed
head -n 1 runs/streamed/samples.jsonl    # the sample ids (piece << 32 | row) of step 1
