"""``raylm`` command line: train, plan, tokenize, plot, tokenizer train.

Every error the user can fix is one line, ``raylm: error: ...``, exit status 2, printed
before any actor starts.
"""

from __future__ import annotations

import gc
import logging
import sys

from raylm.cli.args import (OneLineParser, add_config_arguments, config_from_namespace,
                            load_run_file)
from raylm.errors import ConfigError, TrainingFailed
from raylm.runtime.console import FORMAT

TOKENIZE_FIELDS = ("train_file", "validation_file", "model_name_or_path", "config_name",
                   "model_type", "config_overrides", "tokenizer_name", "block_size",
                   "line_by_line", "text_column", "preprocessing_num_workers", "cache_dir",
                   "data_cache_dir", "model_revision", "token", "trust_remote_code",
                   "keep_linebreaks", "overwrite_cache", "dataset_name",
                   "dataset_config_name", "address", "piece_size_mb")


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="raylm", description="Ray-native trainer for Hugging Face "
                           "transformers: language models and image classifiers, on any "
                           "Ray cluster.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)

    train = sub.add_parser(
        "train", usage="raylm train [RUN_FILE] [--FLAG VALUE ...]",
        help="train or fine-tune a model: causal or masked LM, T5 spans, images",
        description="Train or fine-tune a Hugging Face model on a Ray cluster: causal LM, "
        "masked LM, T5 span corruption or image classification (--task). With no "
        "flags: a tiny GPT-2 on the built-in Shakespeare sample, on a local Ray cluster. "
        "Flags mirror Hugging Face's run_clm.py and TrainingArguments, in either spelling "
        "(--per_device_train_batch_size or --per-device-train-batch-size).")
    train.add_argument("run_file", nargs="?", help="optional YAML or JSON file of flag "
                       "values (flags given on the command line win)")
    add_config_arguments(train)

    plan = sub.add_parser(
        "plan", usage="raylm plan [RUN_FILE] [--json] [--FLAG VALUE ...] (the flags of train)",
        help="show how a run would be laid out, its memory and speed (no weights)",
        description="Show what `raylm train` with these flags would do, without training: "
        "the layout, each worker's memory and the step time. The layout: with "
        "--dp/--tp/--pp all 0, the planner's choice of dp x tp x pp, micro-batches and "
        "pipeline schedule (the fastest predicted layout that fits worker memory); the "
        "predicted memory per worker (parameters, gradients, optimizer states, activations) "
        "and step time; the next best layouts and why each lost; for a pipeline each "
        "stage's pp rank, blocks (module names), parameters and memory; the per-worker "
        "parameter, gradient and optimizer-state bytes at each ZeRO stage (the one the run "
        "would use marked: --zero_stage, else 0 unless memory is short) and which rank "
        "owns which partition. Builds no weights "
        "(the model is built on the meta device), so any model size plans in seconds. The "
        "cluster is taken to hold --num_workers ranks (default: one replica); with "
        "--address, the cluster there is asked for its size and memory (nothing starts), "
        "else no Ray is used and the cost model's defaults are assumed (see "
        "--worker_memory_gb and the other cost-model flags).")
    plan.add_argument("run_file", nargs="?", help="optional YAML or JSON file of flag "
                      "values (flags given on the command line win)")
    plan.add_argument("--json", action="store_true",
                      help="print the plan as one JSON object instead of tables")
    add_config_arguments(plan)

    tok = sub.add_parser(
        "tokenize", usage="raylm tokenize [RUN_FILE] [--FLAG VALUE ...]",
        help="tokenize data into raylm's block cache (train reuses it)",
        description="Tokenize and pack --train_file (and --validation_file) into the "
        "parquet block cache that `raylm train` with the same data, tokenizer and "
        "block size reuses.")
    tok.add_argument("run_file", nargs="?", help="optional YAML or JSON file of flag values")
    add_config_arguments(tok, only=TOKENIZE_FIELDS)

    pl = sub.add_parser(
        "plot", help="draw a run's loss, learning rate, perplexity and throughput",
        description="Write a PNG of the curves in OUTPUT_DIR/metrics.jsonl: training and "
        "evaluation loss (each validation file too), learning rate, perplexity and "
        "throughput (with MFU when logged), failures and resizes marked. Works on a "
        "finished run or one still going.")
    pl.add_argument("output_dir", metavar="OUTPUT_DIR", help="the --output_dir of a run")
    pl.add_argument("-o", "--output", default=None,
                    help="the PNG to write (default: OUTPUT_DIR/metrics.png)")

    tk = sub.add_parser("tokenizer", help="tokenizer tools")
    tk_sub = tk.add_subparsers(dest="tokenizer_command", metavar="COMMAND",
                               parser_class=OneLineParser)
    tkt = tk_sub.add_parser(
        "train", help="train a tokenizer that AutoTokenizer loads",
        description="Train a byte-level BPE (GPT-2 style) or WordPiece (BERT style) "
        "tokenizer on text files and save it for AutoTokenizer.from_pretrained.")
    tkt.add_argument("files", nargs="+", help="files, directories or globs")
    tkt.add_argument("-o", "--output_dir", required=True, help="where to save the tokenizer")
    tkt.add_argument("--type", choices=("bpe", "wordpiece"), default="bpe",
                     help="tokenizer model (default: bpe)")
    tkt.add_argument("--vocab_size", type=int, default=8192, help="(default: 8192)")
    tkt.add_argument("--min_frequency", type=int, default=2, help="(default: 2)")
    tkt.add_argument("--text_column", default=None,
                     help="text column of .jsonl/.csv/.parquet files")
    tkt.add_argument("--lowercase", action="store_true",
                     help="wordpiece: lowercase and strip accents, as BERT's uncased "
                     "tokenizer (default: cased)")
    tkt.add_argument("--extra_ids", type=int, default=0,
                     help="add T5's N sentinel tokens <extra_id_0>... for span corruption "
                     "(T5 has 100; default: 0)")
    return parser


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format=FORMAT, datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _config(ns):
    file_values = load_run_file(ns.run_file) if getattr(ns, "run_file", None) else {}
    return config_from_namespace(ns, file_values)


def cmd_train(ns) -> int:
    from raylm.runtime.driver import train

    result = train(_config(ns))
    m = result.metrics
    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}
    print(f"raylm: done: {result.output_dir}  {shown}")
    return 0


def cmd_plan(ns) -> int:
    import json

    from raylm.report.plan_report import build_plan_report, format_plan_report

    cfg = _config(ns)
    if cfg.address:
        # Plan for that cluster: its size, workers per node and memory (joins, never
        # starts one; without --address, plan imports no Ray at all).
        from raylm.runtime import cluster

        owns = cluster.connect(cfg.address)
        try:
            report = build_plan_report(cfg, cluster.capacity(cfg.cpus_per_worker,
                                                             cfg.use_gpu), from_cluster=True)
        finally:
            if owns:
                cluster.stop_local()
    else:
        report = build_plan_report(cfg)
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(format_plan_report(report)))
    return 0


def cmd_tokenize(ns) -> int:
    from raylm.runtime import cluster
    from raylm.runtime.input_checks import check_inputs
    from raylm.runtime.prepare import prepare_data

    cfg = _config(ns)
    cfg.do_train, cfg.do_eval = True, bool(cfg.validation_file)
    cfg.streaming = False  # (what it builds is the cache)
    inputs = check_inputs(cfg, check_output_dir=False)  # tokenize writes only the cache
    owns = cluster.connect(cfg.address)
    try:
        data = prepare_data(cfg, inputs)
    finally:
        if owns:
            cluster.stop_local()
    for name, ds in (("train", data.train), ("validation", data.eval)):
        if ds is not None:
            print(f"raylm: {name}: {ds.num_samples} samples of {ds.block_size} tokens in "
                  f"{ds.cache_dir} ({'reused' if ds.reused else 'tokenized'})")
    return 0


def cmd_tokenizer_train(ns) -> int:
    from raylm.data.sources import resolve_files, validate_files
    from raylm.data.tokenizer_train import train_tokenizer

    if "://" in ns.output_dir and not ns.output_dir.startswith("file://"):
        raise ConfigError(f"--output_dir {ns.output_dir}: a local directory (--tokenizer_name "
                          "reads the tokenizer from it)")
    files = resolve_files(ns.files, "FILES")
    validate_files(files, ns.text_column, "FILES")
    out = train_tokenizer(files, ns.output_dir, type=ns.type, vocab_size=ns.vocab_size,
                          min_frequency=ns.min_frequency, text_column=ns.text_column,
                          lowercase=ns.lowercase, extra_ids=ns.extra_ids)
    print(f"raylm: tokenizer saved to {out}")
    return 0


def cmd_plot(ns) -> int:
    from raylm.cli.plot import plot_run

    print(f"raylm: wrote {plot_run(ns.output_dir, ns.output)}")
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra:
        # Report against the subcommand's own parser: "see raylm train --help".
        sub = parser._subparsers._group_actions[0].choices.get(ns.command, parser)
        if ns.command == "tokenizer" and ns.tokenizer_command:
            sub = sub._subparsers._group_actions[0].choices[ns.tokenizer_command]
        sub.error("unrecognized arguments: " + " ".join(extra))
    if ns.command is None:
        parser.print_help()
        return 2
    if ns.command == "tokenizer" and ns.tokenizer_command is None:
        parser.parse_args(["tokenizer", "--help"])
    _setup_logging()
    try:
        if ns.command == "train":
            return cmd_train(ns)
        if ns.command == "plan":
            return cmd_plan(ns)
        if ns.command == "tokenize":
            return cmd_tokenize(ns)
        if ns.command == "plot":
            return cmd_plot(ns)
        return cmd_tokenizer_train(ns)
    except ConfigError as e:
        sys.stderr.write(f"raylm: error: {e}\n")
        return 2
    except TrainingFailed as e:
        sys.stderr.write(f"raylm: training failed: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("raylm: interrupted\n")
        return 130


def run(argv=None) -> int:
    """The `raylm` command's entry (and jobs/train.py's): main, then gc.freeze().

    The process ends right after: gc.freeze() moves every object into a generation the
    collector no longer walks, and the interpreter's exit then skips walking the
    hundreds of thousands of objects torch, transformers, Ray and pyarrow left (their
    modules are still cleared, atexit handlers, thread joins and flushes still run),
    most of the time between the last line printed and the exit. Not in main(): a
    program or a test that calls main() goes on, with its garbage collected as usual."""
    code = main(argv)
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(run())
