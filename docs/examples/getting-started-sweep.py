import ray
import raylm

ray.init()  # Ray must outlive the runs: join (or start) it first
with raylm.keep_ranks():
    for lr in (3e-4, 1e-3):
        result = raylm.train(raylm.TrainConfig(
            train_file=["corpus/"], model_type="gpt2",
            config_overrides="n_layer=2,n_embd=64,n_head=2,n_positions=128",
            block_size=64, max_steps=5, num_workers=2, learning_rate=lr,
            output_dir=f"runs/lr-{lr}"))
        print(lr, result.metrics["eval_loss"])
# leaving the block stops the kept rank processes
