"""Every flag of a run, one dataclass per group (the sections of ``raylm train --help``);
TrainConfig (raylm.config) inherits them all, so a flag stays ``cfg.<name>``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

LOG_LEVELS = ("passive", "debug", "info", "warning", "error", "critical")
STRATEGIES = ("no", "steps", "epoch")  # TrainingArguments' IntervalStrategy

# --optim: the HF Trainer's names for torch's AdamW, fused (its default) and not.
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")

SCHEDULER_TYPES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)


def _f(default: Any, help: str, group: str = "training", **extra: Any) -> Any:
    meta = {"help": help, "group": group, **extra}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelFlags:
    """The model (as in run_clm.py): which one and from where, its objective, LoRA."""

    model_name_or_path: Optional[str] = _f(
        None, "Pretrained model to fine-tune (config, weights, tokenizer): a directory saved "
        "with save_pretrained, or a Hugging Face Hub id (gpt2, org/name).", "model")
    config_name: Optional[str] = _f(
        None, "Model config to train from scratch: a directory, a config.json file or a Hub "
        "id.", "model")
    model_type: Optional[str] = _f(
        None, "Model type to train from scratch when no config is given (e.g. gpt2, llama). "
        "Default when nothing names a model: a tiny GPT-2.", "model")
    config_overrides: Optional[str] = _f(
        None, "Override config values when training from scratch, e.g. "
        "\"n_layer=2,n_embd=64,resid_pdrop=0.0\".", "model")
    objective: Optional[str] = _f(
        None, "Training objective: causal (next token), mlm (masked LM, as run_mlm), "
        "span_corruption (T5's pretraining: spans cut from the input, predicted by the "
        "decoder) or seq2seq (an encoder-decoder continues the first half of each block). "
        "Default: the model's own: mlm for encoders with a masked-LM head (BERT, RoBERTa, "
        "DistilBERT, ALBERT), span_corruption for T5, seq2seq for other encoder-decoders, "
        "causal otherwise (raylm.models.objectives).", "model")
    mlm: bool = _f(
        False, "Train with masked language modelling (the same as --objective mlm; the "
        "default for BERT-type models).", "model")
    mlm_probability: float = _f(
        0.15, "Share of tokens selected for masked LM (run_mlm's): of those, 80% become the "
        "mask token, 10% a random token, 10% stay. For span corruption, the noise density "
        "(run_t5_mlm_flax's use of the same flag).", "model")
    mean_noise_span_length: float = _f(
        3.0, "Span corruption: mean length of the spans cut from a sample (run_t5_mlm_flax's "
        "name).", "model")
    whole_word_masking: bool = _f(
        False, "Masked LM selects whole words: the tokens of a word (WordPiece '##' "
        "continuations) are masked together.", "model")
    use_peft: bool = _f(
        False, "Fine-tune with LoRA (peft): the model's weights stay frozen and low-rank "
        "adapters on --lora_target_modules are trained; the output is the adapter "
        "(PeftModel.from_pretrained loads it).", "model")
    lora_rank: Optional[int] = _f(
        None, "LoRA: the adapters' rank r (default: 8).", "model")
    lora_alpha: Optional[float] = _f(
        None, "LoRA: the adapters' scale is lora_alpha / lora_rank (default: 16).", "model")
    lora_dropout: Optional[float] = _f(
        None, "LoRA: dropout on the adapters' input (default: 0.05).", "model")
    lora_target_modules: list = _f(
        [], "LoRA: the layers to adapt, by name (peft's target_modules: a module name's last "
        "part, e.g. q_proj v_proj, or c_attn for GPT-2). Default: peft's for the model type.",
        "model", metavar="NAME")
    merge_lora: bool = _f(
        False, "LoRA: also save the model with the adapters merged into its weights "
        "(output_dir/merged, loads with plain transformers).", "model")
    tokenizer_name: Optional[str] = _f(
        None, "Tokenizer directory or Hub id, if not the model's. Default for a model "
        "trained from scratch: the tokenizer shipped with the built-in sample corpus.",
        "model")
    cache_dir: Optional[str] = _f(
        None, "Where models, tokenizers and datasets from the Hugging Face Hub are stored "
        "(as in run_clm; default: Hugging Face's cache, $HF_HOME). Tokenized blocks have "
        "--data_cache_dir.", "model")
    model_revision: str = _f(
        "main", "Hub revision of the model, config and tokenizer: a branch, tag or commit "
        "id.", "model")
    token: Optional[str] = _f(
        None, "Hub token for private or gated models and datasets (default: $HF_TOKEN or "
        "the one `hf auth login` stored).", "model")
    trust_remote_code: bool = _f(
        False, "Run the Python code a Hub model or dataset repository ships (its own "
        "model class). Off: such a repository is refused. Read the code first.", "model")
    ignore_mismatched_sizes: bool = _f(
        False, "Fine-tune a --model_name_or_path image classifier on classes other than "
        "its own: a new head sized to the data's classes, initialised from --seed (as "
        "run_image_classification's flag). Off: other classes are an error.", "model")


@dataclass
class DataFlags:
    """The data (as in run_clm.py): the text or images trained and evaluated on, and how."""

    task: Optional[str] = _f(
        None, "What to train: unset, a language model (see --objective); "
        "image-classification: an image classifier (ViT and any transformers model with an "
        "image-classification head) on --train_dir, as run_image_classification.", "run",
        choices=("image-classification",))
    train_dir: Optional[str] = _f(
        None, "--task image-classification: the training images, an image folder "
        "(DIR/<class name>/<image>.png|jpg|...).", "data")
    validation_dir: Optional[str] = _f(
        None, "--task image-classification: validation images in the same layout (default: "
        "--train_val_split of --train_dir held out).", "data")
    train_val_split: float = _f(
        0.15, "--task image-classification without --validation_dir: the share of the "
        "training images held out for evaluation.", "data")
    image_size: Optional[int] = _f(
        None, "--task image-classification with a model of your own (model_init): the square "
        "images are decoded to (a transformers model's comes from its config).", "data")
    num_channels: Optional[int] = _f(
        None, "--task image-classification with a model of your own: 3 (RGB, the default) "
        "or 1 (grey).", "data")
    image_flip: bool = _f(
        True, "--task image-classification: flip half the training images left-right, "
        "drawn per (seed, epoch, image), as run_image_classification's "
        "RandomHorizontalFlip (false for pictures a mirror changes, such as digits).",
        "data")
    image_column_name: str = _f(
        "image", "--task image-classification with --dataset_name (or train(..., "
        "train_dataset=)): the column of the images (as run_image_classification).", "data")
    label_column_name: str = _f(
        "label", "--task image-classification with --dataset_name (or train(..., "
        "train_dataset=)): the column of the labels, class names or ids (a ClassLabel "
        "names the classes).", "data")
    dataset_name: Optional[str] = _f(
        None, "Data through datasets.load_dataset, as run_clm: a Hub dataset id, a local "
        "dataset directory, or json / csv / text / parquet to read --train_file and "
        "--validation_file with that builder. Its train and validation splits are used "
        "(images too, with --task image-classification: see --image_column_name).",
        "data")
    dataset_config_name: Optional[str] = _f(
        None, "The dataset's configuration (e.g. wikitext-2-raw-v1).", "data")
    train_file: list = _f(
        [], "Training data: files, directories or globs (.txt, .jsonl/.json, .csv, .parquet; "
        "local paths or s3://, gs://, file:// URIs). Several allowed. Default: the built-in "
        "Shakespeare sample.", "data", nargs="*")
    validation_file: list = _f(
        [], "Validation data, same forms as --train_file. Default: a held-out split of the "
        "training data.", "data", nargs="*")
    validation_split_percentage: float = _f(
        5.0, "Percentage of the training blocks held out for evaluation when no "
        "--validation_file is given.", "data")
    text_column: Optional[str] = _f(
        None, "Column holding the text in .jsonl/.csv/.parquet files (default: 'text', "
        "else the only string column, else 'input_ids' where it holds token ids: rows "
        "tokenized already).", "data")
    block_size: Optional[int] = _f(
        None, "Tokens per training sample. Default: min(model max positions, 1024). "
        "--max_seq_length (run_mlm's name) is the same. Under span corruption: the "
        "encoder's input length (samples are cut longer, as run_t5_mlm_flax).", "data",
        aliases=("max_seq_length",))
    line_by_line: bool = _f(
        False, "Treat each line (or row) as one sample, padded/truncated to block_size, "
        "instead of concatenating and chunking.", "data")
    pad_to_max_length: bool = _f(
        False, "Accepted for run_mlm command lines. raylm always pads --line_by_line samples "
        "to the block size (every layout needs static shapes); padding is masked out of "
        "attention and the loss, so losses equal run_mlm's dynamic padding.", "data")
    keep_linebreaks: bool = _f(
        True, "Keep each line's line break in .txt files (run_clm's default; false joins the "
        "lines' tokens with no break between them).", "data")
    max_train_samples: Optional[int] = _f(
        None, "Train on the first N training samples (blocks) only, for debugging or a "
        "quicker run, as run_clm.", "data")
    max_eval_samples: Optional[int] = _f(
        None, "Evaluate on the first N validation samples (blocks) only.", "data")
    overwrite_cache: bool = _f(
        False, "Tokenize again even when the cache holds these inputs (the new build "
        "replaces the old atomically).", "data")
    preprocessing_num_workers: Optional[int] = _f(
        None, "Parallel tokenization tasks (default: Ray Data decides).", "data")
    data_cache_dir: Optional[str] = _f(
        None, "Where tokenized blocks are cached (default: $RAYLM_CACHE_DIR or "
        "~/.cache/raylm).", "data")
    piece_size_mb: float = _f(
        64.0, "Text and JSON Lines files larger than this (MiB) are read as pieces of this "
        "size, cut at line boundaries, and parquet files as runs of row groups of about "
        "this size: the pieces of one file tokenize in parallel, on any node. Each piece "
        "is packed into blocks on its own.", "data")
    streaming: Optional[bool] = _f(
        None, "Tokenize while training runs instead of into the cache first: Ray Data's "
        "blocks in a seeded, layout-independent order, shuffled within --shuffle_buffer_size "
        "samples; resumable. Needs --max_steps. Unset: on for training data over 1 GiB "
        "when the run allows it.", "data")
    shuffle_buffer_size: int = _f(
        1000, "--streaming: samples per shuffle window (datasets' buffer_size). The "
        "driver holds two or three windows' block references.", "data")
    streaming_buffer_mb: float = _f(
        256.0, "--streaming: object-store memory (MiB) that Ray Data may fill with "
        "tokenized blocks the trainer has not taken yet; beyond it its tasks pause.", "data")


@dataclass
class OptimisationFlags:
    """Optimisation (run_clm / TrainingArguments names)."""

    do_train: Optional[bool] = _f(
        None, "Train. Default: on, unless only --do_eval is given.", "run")
    do_eval: Optional[bool] = _f(
        None, "Evaluate perplexity on the validation split. Alone (without --do_train): "
        "evaluate the given model, no training. Default: on.", "run")
    per_device_train_batch_size: int = _f(
        8, "Micro-batch size per data-parallel replica.")
    per_device_eval_batch_size: int = _f(8, "Evaluation batch size per data-parallel replica.")
    gradient_accumulation_steps: int = _f(
        1, "Micro-batches per optimizer step on each replica. The global batch is "
        "per_device_train_batch_size x gradient_accumulation_steps x dp, and stays fixed "
        "when the cluster changes.")
    learning_rate: float = _f(5e-4, "Peak AdamW learning rate (run_clm's default is 5e-5; "
                              "raylm's default run trains from scratch, so it is higher).")
    weight_decay: float = _f(0.0, "AdamW weight decay (not applied to biases and norms).")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    optim: str = _f(
        "adamw_torch_fused", "The optimizer, by the HF Trainer's names: "
        "adamw_torch_fused (default: torch's AdamW in one fused kernel) or adamw_torch (its "
        "per-tensor loop). The same update to the last bits; a run may resume with the "
        "other.", choices=OPTIMIZERS)
    max_grad_norm: float = _f(1.0, "Gradient clipping norm (0 disables).")
    bf16: bool = _f(
        False, "Mixed precision in bfloat16: the forward and backward under torch.autocast "
        "(matrix multiplies and most activations in bf16), fp32 master weights, gradients "
        "and AdamW state (FSDP2's MixedPrecisionPolicy at --zero_stage 3).")
    fp16: bool = _f(
        False, "Mixed precision in float16, as --bf16, with dynamic loss scaling: a step "
        "whose gradients overflow on any rank is skipped on every rank and the scale "
        "halves (it doubles after --loss_scale_window good steps).")
    torch_dtype: Optional[str] = _f(
        None, "The dtype of the saved model's weights (save_pretrained): float32, bfloat16 "
        "or float16; unset or auto: float32. Training keeps fp32 master weights whatever "
        "it is (a bf16 or fp16 checkpoint is read into them).", "model",
        choices=("auto", "float32", "bfloat16", "float16"), aliases=("dtype",))
    reduce_dtype: str = _f(
        "float32", "The dtype gradients are summed in over data parallelism under --bf16 "
        "or --fp16: float32 (default: a sum over many ranks in bf16 keeps 8 bits of "
        "mantissa, and AdamW then sees the rounding) or bfloat16 (half the bytes on the "
        "wire; ZeRO stages 0 and 3).", choices=("float32", "bfloat16"))
    initial_loss_scale: float = _f(65536.0, "--fp16: the first loss scale (torch's "
                                   "GradScaler default).")
    loss_scale_window: int = _f(2000, "--fp16: good steps in a row after which the loss "
                                "scale doubles.")
    lr_scheduler_type: str = _f("linear", "Learning-rate schedule.", choices=SCHEDULER_TYPES)
    warmup_steps: int = _f(0, "Linear warm-up steps.")
    warmup_ratio: float = _f(
        0.0, "Linear warm-up over this fraction of the training steps, rounded up (used "
        "when --warmup_steps is 0, as TrainingArguments does).")
    lr_scheduler_kwargs: Optional[str] = _f(
        None, "Extra arguments of the schedule, a JSON object, e.g. '{\"num_cycles\": 2}' "
        "for cosine_with_restarts or '{\"power\": 2.0, \"lr_end\": 1e-6}' for polynomial "
        "(TrainingArguments' lr_scheduler_kwargs).")
    num_train_epochs: float = _f(3.0, "Epochs to train (ignored when --max_steps > 0).", "run")
    max_steps: int = _f(-1, "Optimizer steps to train; overrides --num_train_epochs.", "run")
    seed: int = _f(42, "Seed for model init, data order and dropout.")
    per_sample_attention_dropout: bool = _f(
        True, "Draw attention dropout per sample like every other dropout, so a resized run "
        "computes an unchanged run's losses; the model then runs eager attention, slower "
        "than the fused kernel. False keeps fused attention (its dropout drawn per rank).")
    data_seed: Optional[int] = _f(
        None, "Seed for the data order alone (default: --seed), as TrainingArguments: the "
        "same samples in another order with the same initial model.")


@dataclass
class OutputFlags:
    """Logging, evaluation and checkpoints."""

    output_dir: str = _f(
        "raylm-output", "Where the model, metrics and checkpoints go: a directory, or an "
        "object-store URI (s3://bucket/prefix, gs://...) that every node reaches.", "output")
    sync_interval_s: float = _f(
        30.0, "With an object-store --output_dir: seconds between uploads of the driver's "
        "files (metrics, TensorBoard, run record); the model and checkpoints go there "
        "directly.", "output")
    overwrite_output_dir: bool = _f(
        False, "Start afresh in an existing output_dir instead of resuming from it.", "output")
    logging_strategy: str = _f(
        "steps", "When to log loss, learning rate and tokens/s: every --logging_steps "
        "(steps), at each epoch's end (epoch), or never (no).", "output",
        choices=STRATEGIES)
    logging_steps: int = _f(10, "Log loss, learning rate and tokens/s every N steps.", "output")
    eval_strategy: Optional[str] = _f(
        None, "When to evaluate during training: every --eval_steps (steps), at each "
        "epoch's end (epoch), or not (no); with --do_eval the end of training always "
        "evaluates. Default: steps when --eval_steps is given, else no. "
        "--evaluation_strategy is the older name.", "output", choices=STRATEGIES,
        aliases=("evaluation_strategy",))
    eval_steps: Optional[int] = _f(
        None, "Evaluate every N steps as well as at the end (default: only at the end).",
        "output")
    save_strategy: str = _f(
        "steps", "When to write a checkpoint: every --save_steps and at the end (steps), "
        "at each epoch's end and at the end (epoch), or never (no; the model is still "
        "saved, and a failure recovers from memory or restarts from the beginning).",
        "output", choices=STRATEGIES)
    save_steps: int = _f(
        500, "Write a checkpoint every N steps (and at the end of training).", "output")
    save_total_limit: Optional[int] = _f(
        None, "Keep at most N checkpoints, deleting the oldest.", "output")
    save_only_model: bool = _f(
        False, "Checkpoints hold the model alone (a Hugging Face model directory each, with "
        "its tokenizer), no optimizer, schedule or RNG state: smaller, but the run cannot "
        "resume from them (a failure recovers in memory or restarts from the beginning).",
        "output")
    load_best_model_at_end: bool = _f(
        False, "At the end, save the model of the checkpoint with the best "
        "--metric_for_best_model instead of the last one. Needs --save_strategy equal to "
        "--eval_strategy (and --save_steps a multiple of --eval_steps).", "output")
    metric_for_best_model: Optional[str] = _f(
        None, "The evaluation metric that ranks checkpoints: loss (default), perplexity, "
        "or <file>_loss for one of several --validation_file.", "output")
    greater_is_better: Optional[bool] = _f(
        None, "Whether a larger --metric_for_best_model is better (default: false for a "
        "loss or perplexity, true otherwise).", "output")
    early_stopping_patience: Optional[int] = _f(
        None, "Stop training when --metric_for_best_model has not improved for this many "
        "evaluations in a row (the Trainer's EarlyStoppingCallback).", "output")
    early_stopping_threshold: float = _f(
        0.0, "How much an evaluation must beat the best by to count as an improvement for "
        "--early_stopping_patience.", "output")
    resume_from_checkpoint: Optional[str] = _f(
        None, "Checkpoint directory to resume from. Re-running the same command on the same "
        "output_dir resumes from its latest checkpoint anyway.", "output")
    log_sample_ids: bool = _f(
        False, "Also write the sample ids each data-parallel rank trained on, per step, to "
        "output_dir/samples.jsonl (a data audit).", "output")
    profile: bool = _f(
        False, "Trace --profile_steps steps on every rank with torch's profiler (after an "
        "untraced step and one of warm-up) into output_dir/profile/rank-N.json "
        "(chrome://tracing, Perfetto). Every run logs each step's time breakdown in metrics.jsonl regardless.", "output")
    profile_steps: int = _f(
        3, "How many steps --profile traces.", "output")
    disable_tqdm: bool = _f(False, "No progress bar (logs only).", "output")
    log_level: str = _f(
        "passive", "raylm's log level. debug adds each rank's lines (placement, memory); "
        "passive leaves a Python program's own logging setup as it is, and where it has "
        "none shows raylm's info lines, as the command line does.", "output",
        choices=LOG_LEVELS)
    report_to: list = _f(
        [], "Where to send the logged metrics besides output_dir/metrics.jsonl: "
        "tensorboard (event files under --logging_dir), wandb (offline unless WANDB_MODE "
        "says otherwise; needs the wandb package), all (those installed), or none "
        "(the default).", "output", metavar="NAME", choices=("tensorboard", "wandb", "all",
                                                             "none"))
    logging_dir: Optional[str] = _f(
        None, "TensorBoard event directory (default: output_dir/runs).", "output")
    run_name: Optional[str] = _f(
        None, "The run's name in TensorBoard and W&B (default: output_dir's name).", "output")


@dataclass
class ClusterFlags:
    """raylm: cluster and layout."""

    address: Optional[str] = _f(
        None, "Ray cluster to join ('auto', 'ray://host:10001', host:port). Default: "
        "$RAY_ADDRESS, else start a local cluster.", "layout")
    num_workers: int = _f(
        0, "Rank actors (dp x tp x pp). 0: as many as the cluster's CPUs (or GPUs with "
        "--use_gpu) allow.", "layout")
    min_workers: int = _f(
        0, "Elastic lower bound: the fewest rank actors the run carries on with after a "
        "failure (in memory where the layout allows); below it the run waits for capacity "
        "and restarts from the latest checkpoint. 0: one replica (pp x tp).", "elastic")
    max_workers: int = _f(
        0, "Elastic upper bound: raylm asks an autoscaling cluster for this many rank "
        "actors' bundles (ray.autoscaler.sdk.request_resources) and releases the request "
        "when the run ends. 0: no request (the run's start size).", "elastic")
    snapshot_steps: int = _f(
        0, "Every this many steps each rank copies its state into memory on its own node "
        "and another, off the step's path, so losing state with no live copy costs at "
        "most this many steps. Needs two nodes or more. 0: off.", "elastic")
    cpus_per_worker: float = _f(
        1.0, "CPUs each rank actor reserves (fractions allowed); torch uses that many "
        "threads.", "layout")
    dp: int = _f(0, "Data-parallel degree (0: raylm chooses).", "layout")
    tp: int = _f(0, "Tensor-parallel degree (0: raylm chooses).", "layout")
    pp: int = _f(0, "Pipeline-parallel degree (0: raylm chooses).", "layout")
    sequence_parallel: Optional[bool] = _f(
        None, "With --tp > 1: run norms and dropouts on sequence shards too (activation "
        "memory of those parts divided by tp). Unset: off, or on where a tensor-parallel "
        "layout needs it to fit --worker_memory_gb (see `raylm plan`).", "layout")
    gradient_checkpointing: bool = _f(
        False, "Recompute each block's activations in backward instead of keeping them "
        "(full recomputation: about a third more compute; --activation_checkpointing "
        "selective for the cheaper kind).", "layout")
    activation_checkpointing: Optional[str] = _f(
        None, "What each block keeps for backward: none; selective (its input and the "
        "outputs of its matrix multiplies, attention and collectives: the element-wise "
        "rest is recomputed); full (its input only: its forward runs again). Unset: "
        "full with --gradient_checkpointing, else none, or what the planner needs to fit "
        "--worker_memory_gb (see `raylm plan`).", "layout",
        choices=("none", "selective", "full"))
    torch_compile: bool = _f(
        False, "Compile with torch.compile: each transformer block's forward, or the whole "
        "forward and loss (--torch_compile_scope model). Every layout but pipelines cut "
        "by torch.export.", "layout")
    torch_compile_scope: str = _f(
        "blocks", "What --torch_compile compiles: blocks (every layout) or model (the "
        "whole forward and loss; only with no pipeline, no tensor parallelism, ZeRO 0-2 and no "
        "activation checkpointing).", "layout", choices=("blocks", "model"))
    torch_compile_backend: Optional[str] = _f(
        None, "--torch_compile's backend (default: inductor).", "layout")
    torch_compile_mode: Optional[str] = _f(
        None, "--torch_compile's mode (default, reduce-overhead, max-autotune, "
        "max-autotune-no-cudagraphs).", "layout",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    pipeline_schedule: str = _f(
        "1f1b", "Pipeline schedule when pp > 1 (micro-batches per step = "
        "--gradient_accumulation_steps).", "layout",
        choices=("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"))
    pp_virtual_stages: int = _f(
        2, "Stages per rank for --pipeline_schedule interleaved_1f1b (zero_bubble always "
        "runs 2, in a V).", "layout")
    pp_split: Optional[str] = _f(
        None, "Manual pipeline cut: comma-separated block indices where stages 1, 2, ... "
        "begin, e.g. \"3,6,9\" for 4 stages of a 12-block model (default: balanced by "
        "compute and parameters; see `raylm plan`).", "layout")
    zero_stage: Optional[int] = _f(
        None, "ZeRO over each data-parallel group: 0 replicates; 1 partitions optimizer "
        "states, 2 also gradients, 3 also parameters (FSDP2; the model is built on the meta "
        "device and materialised shard by shard). Unset: 0, or the lowest stage that fits "
        "--worker_memory_gb when memory is short (see `raylm plan`).", "layout",
        choices=(0, 1, 2, 3))
    zero_optimization: bool = _f(
        False, "Merak's switch: True is --zero_stage 1.", "layout")
    cpu_offload: bool = _f(
        False, "With --use_gpu and --zero_stage 3: keep the sharded parameters, gradients "
        "and optimizer states in host memory and step on the CPU (FSDP2's "
        "CPUOffloadPolicy).", "layout")
    reshard_after_forward: Optional[bool] = _f(
        None, "ZeRO-3 (FSDP2's option): True frees each block's gathered parameters after "
        "its forward and gathers them again for backward; False keeps them gathered through "
        "the step, for fewer collectives and more memory. Unset: False where it fits "
        "--worker_memory_gb, without --pp or --cpu_offload (see `raylm plan`).", "layout")
    max_failures: int = _f(
        3, "Rank or node failures to recover from (in memory, from a snapshot or from the "
        "latest checkpoint) before the run fails.", "elastic")
    use_gpu: bool = _f(False, "One GPU per rank actor, NCCL between them.", "layout")
    huge_pages: bool = _f(
        True, "Rank processes allocate in transparent huge pages "
        "(glibc.malloc.hugetlb=1), for fewer page faults on the tensors each step frees "
        "and allocates again. A GLIBC_TUNABLES of your own is kept.", "layout")
    collective_timeout_s: float = _f(
        300.0, "Timeout of torch.distributed collectives between rank actors.", "elastic")
    heartbeat_interval_s: float = _f(
        1.0, "How often the driver asks each rank whether it lives (answered on a thread "
        "of the rank's own, beside training).", "elastic")
    heartbeat_timeout_s: float = _f(
        5.0, "A rank silent this long is lost (frozen, or its node cut off): it is ended "
        "and the run recovers.", "elastic")
    step_deadline_factor: float = _f(
        10.0, "A step not done within this many times the recent median step time is "
        "stuck: its ranks furthest behind are ended and the run recovers.", "elastic")
    step_deadline_floor_s: float = _f(
        120.0, "The shortest step deadline (the first steps compile and warm up).",
        "elastic")
    step_protocol: str = _f(
        "ranks", "How steps reach the ranks. driver: one call per rank and step, the "
        "commit decided by the driver. ranks: the ranks run the steps between the driver's "
        "boundaries (an evaluation, a checkpoint, a resize) on their own, derive their "
        "samples and agree each commit among themselves; the driver reads one answer per "
        "step, so its cost does not grow with the ranks. The driver protocol still runs "
        "with callbacks, --fp16, --streaming and --replace_stragglers.", "elastic",
        choices=("driver", "ranks"))
    straggler_factor: float = _f(
        2.0, "A rank whose own work in a step (less its waits on the others) is over this "
        "many times its peers' median is slow in that step.", "elastic")
    straggler_steps: int = _f(
        20, "A rank slow in this many steps in a row is named as a straggler.", "elastic")
    replace_stragglers: bool = _f(
        False, "Replace a straggler with a fresh rank: it is ended, the others carry on "
        "in memory, and a new rank joins where there is room (as when a node joins).",
        "elastic")

    peak_tflops: float = _f(
        0.0, "Peak TFLOP/s of one rank's device in the precision trained, for the model "
        "FLOPs utilisation (mfu) logged with each step. 0: the device's own for known GPUs "
        "(A100, H100, H200, L4, L40S, ...: fp32, or its bf16/fp16 tensor cores under "
        "--bf16/--fp16); none on CPUs.", "costmodel")


@dataclass
class PlannerCostFlags:
    """raylm: the layout planner's cost model (used when --dp/--tp/--pp are all 0)."""

    worker_memory_gb: float = _f(
        0.0, "Memory one rank actor may use, GiB; the planner drops layouts that need more. "
        "0: from the Ray cluster when connected (node memory / workers per node; GPUs: "
        "80), else 16 for CPU workers and 80 with --use_gpu.", "costmodel")
    worker_tflops: float = _f(
        0.0, "Sustained TFLOP/s of one rank for the planner's step-time model. 0: 0.05 per "
        "CPU of --cpus_per_worker, or 50 with --use_gpu (H100, fp32); under --bf16/--fp16 "
        "the CPU figure over 30 (no 16-bit arithmetic) or 400 on GPUs.", "costmodel")
    node_link_gbps: float = _f(
        0.0, "Bandwidth between two ranks on one node, Gbit/s (tensor-parallel "
        "all-reduces). 0: 10 for CPU workers (gloo), 3600 with --use_gpu (NVLink).",
        "costmodel")
    network_gbps: float = _f(
        0.0, "Bandwidth between ranks on different nodes, per rank, Gbit/s. 0: 5 for CPU "
        "workers, 400 with --use_gpu (InfiniBand NDR).", "costmodel")
    workers_per_node: int = _f(
        0, "Rank actors per node for the planner (a tensor-parallel group stays in one "
        "node). 0: from the Ray cluster when connected, else 8.", "costmodel")
