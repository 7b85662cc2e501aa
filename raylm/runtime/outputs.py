"""What a run leaves behind and measures on the way: evaluations, checkpoints, the best
model of them and the model saved at the end (a Hugging Face model directory)."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Optional

from raylm import storage
from raylm.checkpoint.manager import TRAINER_STATE, CheckpointManager, read_trainer_state
from raylm.data.sampler import micro_batches, padded_step_schedule, rank_share
from raylm.models.lora import point_adapter_at_own_base
from raylm.runtime.best import BestTracker
from raylm.runtime.group import WorkerGroup
from raylm.runtime.metrics import MetricsLog, Progress, perplexity
from raylm.runtime.inputs import Data
from raylm.runtime.protocol import loss_result

log = logging.getLogger("raylm")


class Outputs:
    """Evaluation, checkpoints and the saved model of a run (each sees the last step: the
    group sends the pending commit first); ``ckpt`` and ``best`` are a training run's
    (None when it only evaluates)."""

    def __init__(self, cfg, group: WorkerGroup, record, metrics: MetricsLog,
                 progress: Progress, spec=None, ckpt: Optional[CheckpointManager] = None,
                 best: Optional[BestTracker] = None, out=None):
        self.cfg, self.group, self.record = cfg, group, record
        # --output_dir (raylm.runtime.output_dir.OutputDir): the model goes to its dest
        self.out = out
        self.metrics, self.progress = metrics, progress
        self.spec, self.ckpt, self.best = spec, ckpt, best
        self.last_eval = (None, {})  # (step, results) of the latest evaluation

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self, data: Data) -> dict:
        """The loss and perplexity over every evaluation sample, and with several
        validation sets each set's as well (eval_<name>_loss, as the Trainer names the
        metrics of a dict of eval datasets); the overall loss is the token-weighted mean
        of the sets'."""
        step = self.record.step
        sets = data.eval_sets or [(None, data.eval_ids)]
        results, loss_sum, tokens = {}, 0.0, 0
        for name, ids in sets:
            out = self._evaluate_ids(data, ids)
            loss_sum += out.eval_loss * out.eval_tokens
            tokens += out.eval_tokens
            if name is not None:
                results[f"eval_{name}_loss"] = out.eval_loss
                results[f"eval_{name}_perplexity"] = out.perplexity
        loss = loss_sum / max(tokens, 1) if len(sets) > 1 else out.eval_loss
        results = {"eval_loss": loss, "eval_samples": len(data.eval_ids), **results}
        if out.eval_correct is not None:  # image classification: top-1 accuracy
            results["eval_accuracy"] = out.eval_correct / max(out.eval_tokens, 1)
        else:
            results["perplexity"] = perplexity(loss)
        self.metrics.append({"step": step, **results})
        self.progress.write(f"eval at step {step}: loss {loss:.4f}  " + (
                            f"accuracy {results['eval_accuracy']:.4f}"
                            if "eval_accuracy" in results else
                            f"perplexity {results['perplexity']:.2f}") + "".join(
                                f"  {name} {results[f'eval_{name}_loss']:.4f}"
                                for name, _ in data.eval_sets))
        self.last_eval = (step, results)
        return results

    def _evaluate_ids(self, data: Data, ids):
        """The EvalResult of one validation set (raylm.runtime.protocol)."""
        plan = self.record.plan
        eval_ds = data.eval if data.eval is not data.train else None
        return loss_result(self.group.call_each(lambda r, w: w.evaluate.remote(
            self._eval_batches(ids, plan.dims.index(r, "dp")), eval_ds)))

    def _eval_batches(self, eval_ids, dp_index: int) -> list:
        plan = self.record.plan
        share = rank_share(eval_ids, dp_index, plan.dp)
        if plan.pp == 1:
            return micro_batches(share, self.cfg.per_device_eval_batch_size)
        # A pipeline evaluates in chunks of its training step's shape, filled up.
        chunk = plan.micro_batch_size * plan.micro_batches_per_rank
        return [padded_step_schedule(share[i:i + chunk], 1, plan.micro_batch_size,
                                     plan.micro_batches_per_rank)[0]
                for i in range(0, len(share), chunk)]

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, sampler, fingerprint: dict, loss_scale) -> None:
        """The ranks' state at the last step, committed atomically, then rotated
        (``loss_scale``: fp16's scale for the next step, else None)."""
        run, best = self.record, self.best
        tmp = self.ckpt.begin(run.step)
        model_only = self.cfg.save_only_model
        if model_only:  # a Hugging Face model directory, as the final model is saved
            self.group.call("save_pretrained", tmp)
            self.save_tokenizer(tmp)
        else:
            self.group.call("save_checkpoint", tmp)
        self.out.sync(strict=False)  # (an object store's: the metrics up to this step)
        path = self.ckpt.commit(tmp, run.step, {
            "step": run.step, "epoch": sampler.epoch_of(run.step),
            "global_batch_size": run.plan.global_batch_size,
            # --streaming: where the stream continues (raylm.data.stream)
            "stream": (sampler.state_at(run.step) if hasattr(sampler, "state_at")
                       else None),
            "world_size": run.plan.world_size,
            "layout": run.plan.dims.to_dict(),
            "run": fingerprint,
            "model_only": model_only,
            # The evaluations so far (the best one and the patience follow from them),
            # as the Trainer keeps best_metric in its trainer_state.json.
            "evaluations": best.evaluations,
            "saved": best.saved + [run.step],
            "best_metric": best.best_metric,
            "best_global_step": best.best_step,
            "loss_scale": loss_scale.to_dict() if loss_scale is not None else None,
        })
        best.mark_saved(run.step)  # once committed: a failed save has no checkpoint
        if not model_only:
            run.checkpoint = path
        self.ckpt.rotate(self.cfg.save_total_limit, protect=self.best_path())
        log.info("checkpoint saved: %s%s", path, " (model only)" if model_only else "")

    def save_before_data_error(self, sampler, fingerprint: dict, loss_scale) -> None:
        """--streaming met a piece it cannot read: the steps trained since the last
        checkpoint are saved first (when the run saves at all), so nothing trained is
        lost. (Resuming that checkpoint needs the same files: a changed file changes
        the stream, and the resume says so.)"""
        run = self.record
        saved = [step for step, _ in self.ckpt.list()]
        if self.cfg.save_strategy == "no" or run.step == 0 or run.step in saved:
            return
        try:
            self.save_checkpoint(sampler, fingerprint, loss_scale)
        except Exception as e:  # the data error is what the user must see
            log.warning("could not save the steps trained before the data error: %s", e)

    def best_path(self) -> Optional[str]:
        """The checkpoint of the best evaluation that has one (kept by rotation)."""
        step = self.best.best_checkpoint_step
        return self.ckpt.path_for(step) if step is not None else None

    def truncate_after(self, step: int) -> None:
        """Steps after ``step`` will be redone: their evaluations go."""
        self.best.truncate_after(step)

    # -- the model --------------------------------------------------------------------------
    def save_model(self) -> None:
        """The final model into output_dir: with --load_best_model_at_end that of the
        best checkpoint (loaded into the ranks, in whatever layout they have now, or
        copied as it is when the checkpoint is model-only), else the ranks' own."""
        out = self.out.dest
        best, step = self.best_path(), self.best.best_checkpoint_step
        if self.cfg.load_best_model_at_end and best and step != self.record.step:
            if not storage.isfile(storage.join(best, TRAINER_STATE)):
                log.warning("the best checkpoint %s is gone: saving the last model", best)
            elif read_trainer_state(best).get("model_only"):
                with storage.read_dir(best) as src, storage.written_dir(out) as dst:
                    for name in os.listdir(src):
                        path = os.path.join(src, name)
                        if os.path.isdir(path):  # (a LoRA run's base_model/, merged/)
                            shutil.copytree(path, os.path.join(dst, name), dirs_exist_ok=True)
                        elif name != TRAINER_STATE:
                            shutil.copy2(path, os.path.join(dst, name))
                    point_adapter_at_own_base(dst, named_dir=out)
                log.info("saved the model of the best checkpoint, %s (%s)", best,
                         self.best.describe())
                return
            else:
                self.group.call("load_checkpoint", best, step)
                log.info("loaded the best checkpoint, %s, to save its model (%s)", best,
                         self.best.describe())
        self.group.call("save_pretrained", out)

    def save_tokenizer(self, directory: str) -> None:
        """The tokenizer (an image model: its image processor) beside a saved model."""
        from raylm.data.tokenized import load_tokenizer

        if self.spec.objective == "image_classification":  # (no tokenizer: its images')
            from raylm.models.vision import save_image_processor

            with storage.written_dir(directory) as out:
                save_image_processor(self.spec, out)
            return
        # The tokenizer resolve_model loaded (cached), saved beside the model.
        with storage.written_dir(directory) as out:
            load_tokenizer(self.spec.tokenizer_dir).save_pretrained(out)

