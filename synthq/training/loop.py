"""One run on one rank, top to bottom: :func:`train`, the steps of a claimed run
(:mod:`synthq.training.lifecycle` claims it, beats its heartbeat and ends it).

Steps: export the job's examples (synthq.jobs.export; kept in
OUT/data so a resumed run trains on the same snapshot) → a held-out split
(``eval_fraction``, never trained on) → draft vocabulary → target → drafter
(from the last checkpoint if any) → training-time test steps (the loss:
:mod:`synthq.training.loss`, DFlash's :mod:`synthq.training.dflash_loss`) → checkpoints
every ``save_every`` steps (the newest ``keep_checkpoints`` kept) → the served
acceptance length on the held-out split every ``eval_every`` steps and at the
end (``eval_acceptance_length``) → the final drafter in vLLM's layout.

A rank holds the run through a :class:`RunContext`: progress written under the claim's
token, and :class:`Lost` raised once the claim is gone (the write refused, or the
heartbeat's).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from synthq.queue import run_states as states
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Job, TrainingRun
from synthq.training.checkpoint import (
    STEP_PREFIX,
    latest_state,
    plot_metrics,
    prune_states,
    save_drafter,
    save_state,
)
from synthq.training.config import TrainConfig
from synthq.training.data import (
    Example,
    FeatureCache,
    Prefetcher,
    TargetFeatures,
    batches,
    collate,
    draft_head,
    draft_vocab,
    load_examples,
    split_eval,
    supervised,
    target_features,
)
from synthq.training.dflash_loss import block_loss, sample_anchors
from synthq.training.drafters import Drafter, make_drafter
from synthq.training.loss import ttt_loss

__all__ = ["RunContext", "Lost", "EvalProgress", "train", "load_target", "acceptance_estimate"]

log = logging.getLogger(__name__)


class Lost(Exception):
    """The run is no longer this process's (cancelled or taken over)."""


@dataclass
class RunContext:
    run_id: int
    token: str
    rank: int = 0
    world: int = 1
    lost: threading.Event = field(default_factory=threading.Event)

    def check(self) -> None:
        if self.lost.is_set():
            raise Lost()

    def write(self, **values: Any) -> None:
        """Progress to SQL (rank 0 only); raises Lost when the claim is gone."""
        if self.rank != 0:
            return
        with session_scope() as s:
            ok = states.progress(s, self.run_id, self.token, now=utcnow(), **values)
        if not ok:
            self.lost.set()
        if self.lost.is_set():
            raise Lost()


#: ``on_eval(done, total, mean)``: held-out prompts evaluated so far, of how many, and
#: the acceptance length over them (the running mean).
EvalProgress = Callable[[int, int, float], None]


# --- the pieces ----------------------------------------------------------------------------


def load_target(path: str, device: torch.device | None = None) -> Any:
    """The target model in eval mode: bf16 with ``device_map="auto"`` on CUDA, fp32 on CPU."""
    from transformers import AutoModelForCausalLM

    if torch.cuda.is_available():
        device_map: Any = {"": device} if device is not None else "auto"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                     device_map=device_map)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval().requires_grad_(False)


def acceptance_estimate(acc: list[float]) -> float:
    """Expected tokens per target forward: 1 + Σ_k Π_{j<=k} acc_j (chained acceptance)."""
    tau, chain = 1.0, 1.0
    for a in acc:
        chain *= a
        tau += chain
    return tau


def _lr_lambda(total: int, warmup: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


# --- one run on one rank, top to bottom ----------------------------------------------------


def train(ctx: RunContext, on_step: Callable[[int, dict[str, Any]], None] | None,
          say: Callable[[str], None] | None, on_eval: EvalProgress | None = None) -> None:
    """This rank's part of run ``ctx.run_id``, each step a function below, in this order.
    Rank 0 also writes the progress, the checkpoints and the final drafter."""
    run, cfg = _load_run(ctx)
    notice = _notice(ctx, say)
    examples, held_out = _split(ctx, run, cfg, notice)
    device = _device()
    target = _target(run, cfg, ctx.world, device)
    draft_ids, d2t, t2d = draft_vocab(examples, cfg.draft_vocab_size, target.config.vocab_size)
    head = draft_head(target, draft_ids).to(device)  # [V, H] frozen target lm_head rows
    ctx.write()
    opt = _build(target, draft_ids, d2t, t2d, cfg, len(examples), ctx.world, device)
    progress = _resume(ctx, run, cfg, opt, device)
    # The offline cache may free the target here (nothing else needs it): rebound, not kept.
    cache, target = _features(ctx, run, cfg, target, examples, held_out, notice,
                              progress.step, opt.total)
    try:
        evaluate = _Evaluation(ctx, cfg, run.target, target, opt.drafter, held_out, notice,
                               on_eval)
        loop = _Loop(ctx, cfg, run, opt, examples, cache, target, head, device)
        _steps(loop, progress, evaluate, on_step)
        _leave_group(ctx)
        if ctx.rank != 0:
            return
        _finish(loop, progress, evaluate, on_step)
    finally:
        stream = loop_stream(cache)
        if stream is not None:
            stream.close()


def _leave_group(ctx: RunContext) -> None:
    """Every rank leaves the process group together once the last step is taken: leaving
    is collective, and a rank that tore its group down while rank 0 still held it (rank 0
    finishing alone) was aborted by gloo ("terminate called without an active
    exception", CI's run of the 2-rank test). Rank 0 then finishes on its own."""
    if ctx.world <= 1:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@dataclass
class _Run:
    """What training reads of the run's row, once at the start."""

    id: int
    job_id: int
    job: str  # the job's name (plot titles)
    out: Path  # the run's output directory
    target: str  # the target model's path
    metrics: list[dict[str, Any]]  # the records logged so far (a resumed run has some)

    @property
    def title(self) -> str:
        return f"run {self.id} ({self.job})"


def _load_run(ctx: RunContext) -> tuple[_Run, TrainConfig]:
    """The run's row and its checked config; makes the output directory, seeds torch."""
    with session_scope() as s:
        row = s.get(TrainingRun, ctx.run_id)
        assert row is not None
        job = s.get(Job, row.job_id)
        if job is not None:  # a run beat started for a job without a tokenizer: say so
            from synthq.training.runs import check_trainable

            check_trainable(job)
        run = _Run(ctx.run_id, row.job_id, job.name if job else str(row.job_id),
                   Path(row.output_dir), row.target, list(row.metrics or []))
        settings = row.settings
    cfg = TrainConfig.from_dict(settings)
    cfg.check()
    run.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    return run, cfg


def _notice(ctx: RunContext, say: Callable[[str], None] | None) -> Callable[[str], None]:
    """A notice of the run: to the log on every rank, to ``say`` on rank 0."""
    def notice(line: str) -> None:
        log.info("training run %d: %s", ctx.run_id, line)
        if say is not None and ctx.rank == 0:
            say(line)
    return notice


def _split(ctx: RunContext, run: _Run, cfg: TrainConfig,
           notice: Callable[[str], None]) -> tuple[list[Example], list[Example]]:
    """The job's examples (exported once), split into (trained on, held out)."""
    every = load_examples(_prepare_data(ctx, run), cfg.max_len)
    examples, held_out = split_eval(every, cfg.eval_fraction, cfg.seed)
    if cfg.max_examples and cfg.max_examples < len(examples):
        notice(f"training on {cfg.max_examples} of the {len(examples)} training examples "
               "(max_examples)")
        examples = examples[:cfg.max_examples]
    if held_out:
        notice(f"{len(held_out)} of {len(every)} examples held out for evaluation "
               f"(never trained on)")
    return examples, held_out


def _prepare_data(ctx: RunContext, run: _Run) -> Path:
    """The job's examples exported into OUT/data once (reused when resuming)."""
    from synthq.jobs.export import export_job

    data = run.out / "data"
    if ctx.rank == 0 and not (data / "manifest.json").is_file():
        export_job(run.job_id, data, fmt="parquet", include_truncated=True,
                   allow_stale=True)
    if ctx.world > 1:  # every rank, whoever saw the manifest first (else rank 0 waits forever)
        import torch.distributed as dist

        dist.barrier()
    return data


def _device() -> torch.device:
    """This rank's GPU (LOCAL_RANK) with CUDA, else the CPU."""
    if torch.cuda.is_available():
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    return torch.device("cpu")


def _target(run: _Run, cfg: TrainConfig, world: int, device: torch.device) -> Any:
    """The target: whole, or only its head for ``--features captured`` and ``stream``."""
    if cfg.hidden_states in ("captured", "stream"):
        # The engine computed the features: of the target, only its embeddings, final
        # norm and lm_head are loaded (synthq.training.captured).
        from synthq.training.captured import load_target_head

        return load_target_head(run.target)
    return load_target(run.target, device if world > 1 else None)


@dataclass
class _Optimization:
    """The drafter and what steps it: made by :func:`_build`, restored by :func:`_resume`."""

    drafter: Drafter
    params: list[torch.nn.Parameter]  # the trained ones (the embeddings stay frozen)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    per_epoch: int  # optimizer steps per epoch (a batch of batch_size per rank)
    total: int  # optimizer steps in all (epochs, or max_steps when fewer)


def _build(target: Any, draft_ids: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
           cfg: TrainConfig, n_examples: int, world: int,
           device: torch.device) -> _Optimization:
    """A drafter of the run's family initialised from the target, AdamW, and
    warmup-then-cosine over the run."""
    drafter = make_drafter(cfg, target.config, len(draft_ids))
    drafter.init_from_target(target, draft_ids)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    drafter.to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(n_examples / (cfg.batch_size * world))
    total = per_epoch * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(total, max(1, int(cfg.warmup_ratio * total))))
    return _Optimization(drafter, params, optimizer, scheduler, per_epoch, total)


@dataclass
class _Progress:
    """What the steps change: the step count, the records, the window being averaged."""

    step: int
    metrics: list[dict[str, Any]]
    window: dict[str, Any]  # sums since the last record (:func:`_window`)
    eval_accept: float | None = None  # the latest held-out acceptance length


def _resume(ctx: RunContext, run: _Run, cfg: TrainConfig, opt: _Optimization,
            device: torch.device) -> _Progress:
    """From the latest checkpoint, if any: weights, optimizer moments, schedule, step; the
    records after that step are dropped (they are trained again)."""
    step = 0
    metrics = run.metrics
    last = latest_state(run.out / "checkpoints")
    if last is not None:
        state = torch.load(last / "state.pt", map_location=device, weights_only=False)
        opt.drafter.load_state_dict(state["drafter"], strict=False)
        opt.optimizer.load_state_dict(state["optimizer"])
        opt.scheduler.load_state_dict(state["scheduler"])
        step = int(state["step"])
        metrics = [m for m in metrics if m["step"] <= step]
        log.info("training run %d: resuming from %s (step %d)", ctx.run_id, last, step)
    ctx.write(total_steps=opt.total, resumed_from=step, step=step, metrics=metrics,
              **({"checkpoint": str(last)} if last else {}))
    return _Progress(step, metrics, _window(cfg.ttt_steps))


def loop_stream(cache: FeatureCache | None) -> Any:
    """The run's :class:`synthq.training.stream.Stream` (``--features stream``), else None."""
    from synthq.training.stream import Stream

    return cache if isinstance(cache, Stream) else None


def _features(ctx: RunContext, run: _Run, cfg: TrainConfig, target: Any, examples: list[Example],
              held_out: list[Example], notice: Callable[[str], None], resumed: int = 0,
              total: int = 0) -> tuple[FeatureCache | None, Any]:
    """Where each batch's target features come from: (cache, target). The engine's captured
    hidden states (stored by ``synthq capture``, or streamed ahead of the trainer into a
    bounded spool from step ``resumed`` of ``total``), or an offline cache computed now
    (this rank's share), or none (online: the target runs in every step). The target
    comes back None when the offline cache replaces it and no evaluation needs it."""
    if cfg.hidden_states == "stream":
        from synthq.capture.plan import drafter_layers
        from synthq.training.stream import Stream, plan_steps

        stream = Stream(ctx=ctx, run_id=run.id, job_id=run.job_id, out=run.out,
                        spool=cfg.spool, head=target, examples=examples,
                        steps=plan_steps(examples, cfg.batch_size, ctx.world, cfg.seed, total),
                        layers=drafter_layers(target.config.num_hidden_layers),
                        resumed=resumed, notice=notice)
        ctx.write(spool_size=cfg.spool)
        try:
            stream.start(resumed)
        except BaseException:
            stream.close()
            raise
        return stream, target
    if cfg.hidden_states == "captured":
        from synthq.capture.plan import drafter_layers
        from synthq.training.captured import CapturedFeatures, captured_paths

        layers = drafter_layers(target.config.num_hidden_layers)
        cache: FeatureCache = CapturedFeatures(captured_paths(run.job_id, layers), target)
        mine = [ex for i, ex in enumerate(examples) if i % ctx.world == ctx.rank]
        cache.fill(None, mine)
        notice(f"features: {len(mine)} examples' captured hidden states (layers {layers})")
        return cache, target
    if cfg.hidden_states == "offline":
        cache = FeatureCache(run.out / "cache")
        mine = [ex for i, ex in enumerate(examples) if i % ctx.world == ctx.rank]
        cache.fill(target, mine, heartbeat=ctx.check, say=notice)
        if ctx.world > 1:
            import torch.distributed as dist

            dist.barrier()
        # Without a held-out split the cache replaces the target: the caller drops it,
        # freeing its memory for training.
        return cache, (target if held_out else None)
    return None, target


class _Evaluation:
    """The served acceptance length on the held-out split: ``evaluation(step)`` on rank 0
    returns it (and says it), elsewhere or with no held-out split None."""

    def __init__(self, ctx: RunContext, cfg: TrainConfig, target_path: str, target: Any,
                 drafter: Drafter, held_out: list[Example],
                 notice: Callable[[str], None], on_eval: EvalProgress | None) -> None:
        self.ctx, self.cfg, self.target_path, self.target = ctx, cfg, target_path, target
        self.drafter, self.held_out, self.notice, self.on_eval = drafter, held_out, notice, on_eval

    def __call__(self, at: int) -> float | None:
        if not self.held_out or self.ctx.rank != 0:
            return None
        from synthq.training.speculate import acceptance_length

        cfg, t0 = self.cfg, time.perf_counter()
        self.drafter.eval()
        judge = self.target
        if cfg.hidden_states in ("captured", "stream"):
            # The features came from the engine; judging needs the whole target, loaded
            # for the evaluation only (use --eval-fraction 0 for one no process can load,
            # and measure the served acceptance with the engine instead).
            judge = load_target(self.target_path)
        result = acceptance_length(judge, self.drafter, self.held_out, cfg.eval_draft_tokens,
                                   max_new=cfg.eval_max_new, heartbeat=self.ctx.check,
                                   progress=_eval_progress(self.ctx.run_id, at, self.on_eval))
        self.drafter.train()
        self.notice(f"step {at}: eval acceptance length {result.mean:.3f} "
                    f"({cfg.eval_draft_tokens} draft tokens, {result.rounds} verify rounds on "
                    f"{len(self.held_out)} held-out prompts, {time.perf_counter() - t0:.1f} s)")
        return result.mean


def _eval_progress(run_id: int, at: int, on_eval: EvalProgress | None) -> EvalProgress:
    """Each held-out prompt to ``on_eval``, and to the log every tenth of them (a worker's
    evaluation is not silent for minutes either)."""
    def progress(done: int, total: int, mean: float) -> None:
        if on_eval is not None:
            on_eval(done, total, mean)
        if done == total or done % max(1, total // 10) == 0:
            log.info("training run %d: step %d evaluation: %d/%d held-out prompts, acceptance "
                     "length %.3f so far", run_id, at, done, total, mean)
    return progress


class _Loop:
    """What every step reads, set up once: the drafter (in DDP with several ranks), bf16
    autocast on CUDA, and the draft vocabulary's maps."""

    def __init__(self, ctx: RunContext, cfg: TrainConfig, run: _Run, opt: _Optimization,
                 examples: list[Example], cache: FeatureCache | None, target: Any,
                 head: torch.Tensor, device: torch.device) -> None:
        self.ctx, self.cfg, self.run, self.opt = ctx, cfg, run, opt
        self.examples, self.cache, self.target = examples, cache, target
        self.head, self.device = head, device  # head: [V, H] frozen target lm_head rows
        cuda = torch.cuda.is_available()
        self.model: torch.nn.Module = opt.drafter
        if ctx.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(opt.drafter,
                                                 device_ids=[device.index] if cuda else None)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else _nullcontext()
        self.d2t = opt.drafter.draft_to_target  # [V] target id of each draft id
        self.t2d = opt.drafter.t2d  # [T] bool: target ids in the draft vocabulary
        self.checkpoints = run.out / "checkpoints"


def _steps(loop: _Loop, p: _Progress, evaluate: _Evaluation,
           on_step: Callable[[int, dict[str, Any]], None] | None) -> None:
    """The optimizer steps from ``p.step`` to the total, epoch by epoch; a resumed run
    skips the batches of its epoch already trained on. Each rank takes its share of a
    batch (at least one example)."""
    ctx, cfg, opt, examples = loop.ctx, loop.cfg, loop.opt, loop.examples
    opt.drafter.train()
    stream = loop_stream(loop.cache)
    while p.step < opt.total:
        epoch, skip = divmod(p.step, opt.per_epoch)
        order = batches(examples, cfg.batch_size * ctx.world, cfg.seed, epoch)
        mine = [b[ctx.rank::ctx.world] or b[:1] for b in order][skip:]
        prefetch = Prefetcher(loop.cache, examples, mine) \
            if loop.cache is not None and stream is None else None
        try:
            for j, idx in enumerate(mine):
                if p.step >= opt.total:
                    break
                ids, loss_mask, valid = collate(examples, idx)
                loss_mask = supervised(loss_mask, valid, cfg.supervise)
                t0 = time.perf_counter()
                if stream is not None:  # its files in the spool, a commit when it is full
                    stream.before(p.step, lambda: _commit(loop, p))
                    feats = stream.take(p.step, idx, ids.shape[1])
                elif prefetch is not None:
                    feats = prefetch.get(j, ids.shape[1])
                else:
                    feats = target_features(loop.target, ids)
                t1 = time.perf_counter()
                loss, stats = _step(loop, ids, feats, loss_mask, p.step)
                p.step += 1
                _accumulate(p.window, float(loss.detach()), stats, int(valid.sum()), t1 - t0,
                            time.perf_counter() - t1)
                _after_step(loop, p, evaluate, on_step)
        finally:
            if prefetch is not None:
                prefetch.close()


def _step(loop: _Loop, ids: torch.Tensor, feats: TargetFeatures, loss_mask: torch.Tensor,
          done: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """One optimizer step on a batch ([B, L] ids): the unrolled training-time test (EAGLE-3)
    or the blocks at random anchors (DFlash), its loss, backward, clip, AdamW, the
    schedule. Returns the loss and (correct, counted) per step (per block slot). ``done``:
    the steps before this one (DFlash's anchors are drawn from the seed, the rank and it,
    so a resumed run draws what the uninterrupted one drew)."""
    cfg, opt, device = loop.cfg, loop.opt, loop.device
    with loop.autocast:
        if cfg.drafter == "dflash":
            gen = torch.Generator().manual_seed(
                (cfg.seed * 1_000_003 + loop.ctx.rank) * 1_000_033 + done)
            anchors, keep = sample_anchors(loss_mask, cfg.dflash_anchors, gen)
            logits = loop.model(ids.to(device), feats.aux.to(device), anchors.to(device))
            loss, stats = block_loss(logits, feats, loss_mask, anchors, keep, loop.d2t,
                                     cfg.ttt_decay, loop.head, loop.t2d)
        else:
            logits = loop.model(ids.to(device), feats.aux.to(device), cfg.ttt_steps)
            loss, stats = ttt_loss(logits, feats, loss_mask, loop.d2t, cfg.ttt_decay,
                                   loop.head, loop.t2d)
    opt.optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(opt.params, cfg.grad_clip)
    opt.optimizer.step()
    opt.scheduler.step()
    return loss, stats


def _after_step(loop: _Loop, p: _Progress, evaluate: _Evaluation,
                on_step: Callable[[int, dict[str, Any]], None] | None) -> None:
    """Every ``eval_every`` steps an evaluation; every ``log_every`` (and with an evaluation,
    and at the last step) a record, to ``on_step`` and SQL; then the claim checked; every
    ``save_every`` steps a checkpoint (rank 0)."""
    cfg, ctx, step, total = loop.cfg, loop.ctx, p.step, loop.opt.total
    evaluated = None
    if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
        evaluated = evaluate(step)
    if step % cfg.log_every == 0 or step == total or evaluated is not None:
        record = _record(p.window, step, float(loop.opt.scheduler.get_last_lr()[0]))
        if evaluated is not None:
            record["eval_accept"] = p.eval_accept = evaluated
        p.metrics.append(record)
        p.window = _window(cfg.ttt_steps)
        if on_step:
            on_step(step, record)
        ctx.write(step=step, metrics=p.metrics,
                  **({"eval_acceptance_length": evaluated} if evaluated is not None else {}))
    if ctx.lost.is_set():
        raise Lost()
    stream = loop_stream(loop.cache)
    # The last step too, before the final evaluation: a run stopped during
    # it resumes there instead of redoing the steps since the last save.
    if step % cfg.save_every == 0 or step == total:
        if ctx.rank == 0:
            path = _save(loop, step)
            plot_metrics(p.metrics, loop.run.out / "metrics.png", loop.run.title)
            ctx.write(step=step, checkpoint=str(path), metrics=p.metrics)
        if stream is not None:  # the checkpoint is committed: what it trained on, consumed
            stream.commit(step)
    if stream is not None:
        figures = stream.figures()
        if figures:
            ctx.write(**figures)


def _commit(loop: _Loop, p: _Progress) -> None:
    """A checkpoint of step ``p.step`` now (``--features stream``: the spool is full of
    files trained on since the last one), and what it trained on consumed."""
    if loop.ctx.rank == 0 and not (loop.checkpoints / f"{STEP_PREFIX}{p.step:08d}").is_dir():
        path = _save(loop, p.step)
        loop.ctx.write(step=p.step, checkpoint=str(path), metrics=p.metrics)
    stream = loop_stream(loop.cache)
    if stream is not None:
        stream.commit(p.step)


def _save(loop: _Loop, step: int) -> Path:
    """A resumable checkpoint of ``step``; the newest ``keep_checkpoints`` are kept."""
    opt = loop.opt
    path = save_state(loop.checkpoints, step, opt.drafter, opt.optimizer, opt.scheduler,
                      loop.cfg.to_dict(), {"run_id": loop.ctx.run_id})
    prune_states(loop.checkpoints, loop.cfg.keep_checkpoints)
    return path


def _finish(loop: _Loop, p: _Progress, evaluate: _Evaluation,
            on_step: Callable[[int, dict[str, Any]], None] | None) -> None:
    """Rank 0, after the last step: the final evaluation (into the last record), a
    checkpoint if the last step has none, the drafter in vLLM's layout, the plots, and
    the run finished (``Lost`` when its claim is gone)."""
    ctx, cfg, run, step, metrics = loop.ctx, loop.cfg, loop.run, p.step, p.metrics
    final_accept = evaluate(step)
    if final_accept is not None:
        p.eval_accept = final_accept
        if metrics and metrics[-1]["step"] == step:
            metrics[-1]["eval_accept"] = final_accept
        if on_step and metrics:
            on_step(step, metrics[-1])
    if not (loop.checkpoints / f"{STEP_PREFIX}{step:08d}").is_dir():  # e.g. a run of 0 steps
        _save(loop, step)
    stream = loop_stream(loop.cache)
    figures: dict[str, Any] = {}
    if stream is not None:
        stream.commit(step)
        figures = stream.done()
    final = save_drafter(run.out / "final", loop.opt.drafter, cfg.to_dict())
    plot_metrics(metrics, run.out / "metrics.png", run.title)  # redrawn with the final evaluation
    plot_metrics(metrics, final / "metrics.png", run.title)
    with session_scope() as s:
        if not states.finish(s, ctx.run_id, ctx.token, checkpoint=str(final), now=utcnow(),
                             step=step, metrics=metrics, **figures,
                             **({"eval_acceptance_length": p.eval_accept}
                                if p.eval_accept is not None else {})):
            raise Lost()


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _window(steps: int) -> dict[str, Any]:
    return {"loss": 0.0, "n": 0, "correct": [0] * steps, "count": [0] * steps, "tokens": 0,
            "target_s": 0.0, "draft_s": 0.0}


def _accumulate(w: dict[str, Any], loss: float, stats: list[tuple[int, int]], tokens: int,
                target_s: float, draft_s: float) -> None:
    w["loss"] += loss
    w["n"] += 1
    for k, (c, n) in enumerate(stats):
        w["correct"][k] += c
        w["count"][k] += n
    w["tokens"] += tokens
    w["target_s"] += target_s
    w["draft_s"] += draft_s


def _record(w: dict[str, Any], step: int, lr: float) -> dict[str, Any]:
    acc = [c / n if n else 0.0 for c, n in zip(w["correct"], w["count"], strict=True)]
    seconds = w["target_s"] + w["draft_s"]
    return {"step": step, "loss": w["loss"] / max(1, w["n"]), "acc": acc,
            "accept": acceptance_estimate(acc), "lr": lr, "tokens": w["tokens"],
            "tokens_per_s": w["tokens"] / seconds if seconds else None,
            "target_share": w["target_s"] / seconds if seconds else None}

