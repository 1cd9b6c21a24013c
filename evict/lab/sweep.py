"""Run a grid of independent jobs across processes, resumably: a job is done when its result.json exists."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import multiprocessing as mp
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from evict.cli_args import first_line, out_of_memory
from evict.distributed import resolve_device
from evict.jsonfile import read_json_object
from evict.train import TrainConfig, write_json


T = TypeVar("T")


def from_json(kind: Callable[..., T], d: dict) -> T:
    """A sweep (or other dataclass of tuples) from its JSON dict, where the tuples came back as lists."""
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return kind(**fields)


@dataclasses.dataclass(frozen=True)
class SharedOutOfMemory:
    """What a worker returns for a job that ran out of memory while other jobs shared the machine: the error's first
    line. run_jobs puts the job back in its queue and runs fewer at once."""

    message: str


def _worker(args):
    i, fn, job, threads, shared = args
    import torch

    torch.set_num_threads(threads)
    try:
        return i, fn(job)
    except Exception as e:
        if not (shared and out_of_memory(e)):  # alone (or no pool): a lack of memory is the job's own, as before
            raise
        message = first_line(e)
    finally:
        # a worker process lives on between jobs (idle once run_jobs runs fewer at once): hand the blocks its
        # allocator keeps cached back to the other processes on the card (nothing to do, and no gc pass, without)
        if torch.cuda.is_initialized():
            gc.collect()
            torch.cuda.empty_cache()
    return i, SharedOutOfMemory(message)  # the error's frames, and the tensors they held, are gone by now


def run_jobs(fn: Callable[[dict], dict | None], jobs: list[dict], *, workers: int = 1,
             desc: str = "runs", first: Callable[[dict], Any] | None = None) -> list[dict | None]:
    """Apply fn to every job (a dict with a "dir" key) not already finished; returns all results in job order.
    `first`: a sort key for the order the unfinished jobs go to the workers in (smallest first; ties keep job order).

    fn must be a module-level function (it is pickled to worker processes) and write nothing but under job["dir"].
    A finished job's result is read back from <dir>/result.json, so an interrupted sweep resumes where it stopped.
    fn returns None for a job it left unfinished (e.g. out of time): no result.json, None in the returned list.

    With several workers, a job that runs out of memory (host or device) while others run beside it goes back to the
    front of the queue, and from then on the sweep runs one job fewer at a time (session 50: 8 pairs ladders on one
    H100 ran out of its 80 GB and the error ended the piece). It runs again once fewer run (a trained run resumes from
    its checkpoint, if its fn writes them); one that runs out of memory alone ends the sweep with the error.
    """
    results: dict[int, dict | None] = {}
    todo = []
    for i, job in enumerate(jobs):
        done = Path(job["dir"]) / "result.json"
        if done.exists():  # written whole or not at all (below); one that is not an object names itself
            results[i] = read_json_object(done, "out")
        else:
            todo.append(i)
    if first is not None:
        todo.sort(key=lambda i: first(jobs[i]))
    threads = max(1, (os.cpu_count() or 1) // max(workers, 1))
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc=desc, dynamic_ncols=True)

    def keep(i: int, res: dict | None) -> None:
        results[i] = res
        if res is None:
            return
        out = Path(jobs[i]["dir"]) / "result.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, res)
        bar.set_postfix_str(res.get("label", ""))
        bar.update(1)

    pool = None
    try:
        if workers <= 1:
            for i in todo:
                keep(*_worker((i, fn, jobs[i], threads, False)))
        else:  # an executor, not mp.Pool: a worker killed by the system breaks it (an error) instead of hanging
            pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
            queue, limit = deque(todo), workers
            flying: dict[Future, int] = {}  # a job's future -> its index
            peak: dict[Future, int] = {}  # the most jobs in flight at once while it was, itself included
            while queue or flying:
                while queue and len(flying) < limit:
                    i = queue.popleft()
                    # alone: nothing else runs now, and nothing will start beside it (none queued, or limit 1)
                    shared = bool(flying) or (limit > 1 and bool(queue))
                    flying[pool.submit(_worker, (i, fn, jobs[i], threads, shared))] = i
                    for f in flying:
                        peak[f] = max(peak.get(f, 0), len(flying))
                ended, _ = wait(flying, return_when=FIRST_COMPLETED)
                for f in ended:
                    flying.pop(f)
                    ran = peak.pop(f)
                    i, res = f.result()
                    if isinstance(res, SharedOutOfMemory):
                        limit = max(1, min(limit, ran) - 1)
                        queue.appendleft(i)
                        bar.write(f"{desc}: {jobs[i]['dir']} ran out of memory with other runs beside it "
                                  f"({res.message}); it goes back in the queue, and at most {limit} now run at once")
                        continue
                    keep(i, res)
    except BrokenProcessPool:
        kept = sum(r is not None for r in results.values())
        raise MemoryError(f"a worker process of the sweep was killed, most likely by the system for lack of memory; "
                          f"{kept} of {len(jobs)} runs are finished and kept: run again with fewer workers") from None
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return [results.get(i) for i in range(len(jobs))]


def check_minutes(minutes: float | None) -> None:
    """A timed piece's length: None or a positive number (checked before a sweep writes anything)."""
    if minutes is not None and not minutes > 0:
        raise ValueError(f"minutes: expected a positive number, got {minutes}")


def with_deadline(jobs: list[dict], minutes: float | None) -> list[dict]:
    """The jobs of a timed piece (`--minutes`): each gets a wall-clock `stop_at` that many minutes from now, which its
    run honours (out_of_time before it starts, piece_fields while it trains), and the piece's length (`piece_seconds`,
    for a run's start rule). None: the jobs as they are."""
    check_minutes(minutes)
    if minutes is None:
        return jobs
    stop_at = time.time() + 60 * minutes
    return [{**job, "stop_at": stop_at, "piece_seconds": 60 * minutes} for job in jobs]


def out_of_time(job: dict) -> bool:
    """Whether a job's piece is over (a run that has not started is left for the next piece)."""
    return job.get("stop_at") is not None and time.time() >= job["stop_at"]


def piece_fields(job: dict, every: int) -> dict:
    """TrainConfig fields of a run in a timed piece: stop at the job's stop_at, checkpointing every `every` steps so the
    next piece resumes it where it stopped (train() then returns interrupted, and the run's fn returns None)."""
    return {} if job.get("stop_at") is None else {"stop_at": job["stop_at"], "checkpoint_every": every}


def compiles(sweep: Any) -> bool:
    """Whether a sweep's runs put each block through torch.compile: on CUDA, when the sweep has `compile` set."""
    return bool(getattr(sweep, "compile", False)) and resolve_device(sweep.device).type == "cuda"


def fresh_compile(sweep: Any) -> None:
    """Before each run of a compiling sweep (`compiles`): a worker process trains many runs in turn, and without a
    reset the compiled code of every earlier model stays cached; once a block's forward reaches dynamo's recompile
    limit (8) later runs go eager (seen on the H200 from the 13th run of a recall piece on: "hit
    config.recompile_limit (8)")."""
    if compiles(sweep):
        torch._dynamo.reset()


def lab_train_config(sweep: Any, seed: int, job: dict | None = None, **fields) -> TrainConfig:
    """The TrainConfig of a lab run at one learning rate (`sweep.lr`): AdamW weight decay 0.1, no warmup, the sweep's
    steps, batch and evaluations, CUDA graphs on a GPU (and each block compiled where the sweep has `compile`,
    `compiles`); a job's folder and its piece's stop and checkpoints
    (piece_fields); then `fields` (TrainConfig fields) laid over them, e.g. the hybrid lab's MQAR schedule."""
    on_gpu = resolve_device(sweep.device).type == "cuda"
    shared = dict(steps=sweep.steps, batch_size=sweep.batch_size, lr=sweep.lr, weight_decay=0.1, warmup_steps=0,
                  eval_every=sweep.eval_every, eval_batches=sweep.eval_batches, seed=seed, device=sweep.device,
                  progress=False, log_every=50, graphs=on_gpu, compile=compiles(sweep))
    run = {} if job is None else {"out_dir": job["dir"], **piece_fields(job, sweep.eval_every)}
    return TrainConfig(**{**shared, **run, **fields})


def diverged(res) -> dict:
    """A lab row's note when its run stopped because the training loss was no longer finite (`TrainResult.diverged_at`):
    the row's numbers come from the evaluations before that step."""
    return {} if res.diverged_at is None else {"diverged": f"training loss not finite by step {res.diverged_at}"}


def curve(res, key: str = "accuracy") -> list[list[float]]:
    """A lab row's learning curve: the run's validation `key` ("accuracy" or "loss") at every evaluation, as [[step,
    value], …] to 4 decimals, a resumed run's earlier pieces included (`TrainResult.history`): it tells a run that
    ended below its target still climbing from one that had stalled."""
    return [[h["step"], round(float(h[key]), 4)] for h in res.history]  # history: the evaluations, nothing else


def stopped_message(minutes: float | None, jobs: list, left: int, root: Path) -> str:
    """What a sweep with runs left says: how many finished, how long the piece took, and how to continue. A piece
    ends before its `minutes` when no run left would finish in time (expected_seconds), so the time is measured."""
    after = ""
    stop_at = next((j["stop_at"] for j in jobs if j.get("stop_at") is not None), None)
    if minutes is not None and stop_at is not None:
        took = max(0.0, time.time() - (stop_at - 60 * minutes)) / 60
        after = f" after {took:.1f} min (a piece of at most {minutes:g} min)"
    return (f"stopped{after}: {len(jobs) - left} of {len(jobs)} runs finished, {left} left (unfinished ones resume "
            f"from their checkpoints); run the same command with --out {root} to continue")


def sweep_folder(kind: str, sweep, out: str | Path | None, *, defaults: dict | None = None,
                 which: tuple[str, ...] = (), unordered: tuple[str, ...] = ()) -> Path:
    """The folder of a sweep (a dataclass): `out`, or runs/<kind>/<timestamp>/, with the sweep's config.json. A folder
    that already holds another config is refused; `defaults` (the config's fields at their defaults) fills in fields
    a saved config predates, so an older sweep still resumes. `which`: fields that only choose which runs exist (a
    lab's WHICH_FIELDS: seeds, tasks, models; each run's folder names its own), so a sweep may grow or narrow them
    over a folder and keep the runs it shares with the one before; config.json then says the new values, and the
    old sweep's rows, table and plot go. `unordered`: list fields whose order only says which run goes first (a lab's
    UNORDERED_FIELDS: pairs' lrs), compared as sets; config.json then says the new order."""
    root = Path(out) if out else Path("runs") / kind / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    cfg_path = root / "config.json"
    want = json.loads(json.dumps(dataclasses.asdict(sweep)))
    had = {**(defaults or {}), **read_json_object(cfg_path, "out")} if cfg_path.exists() else None
    differ = [] if had is None else config_differences(had, want, which, unordered)
    if differ:
        raise ValueError(f"out: {root} holds a sweep with another config ({', '.join(differ)} differ); use a new "
                         "folder or the same options")
    if had is not None and config_differences(had, want):  # so only `which` or `unordered` fields differ
        for name in ("results.jsonl", "table.md", f"{kind}.png"):  # the old runs' results; the new sweep writes its own
            (root / name).unlink(missing_ok=True)
    write_json(cfg_path, want)
    return root


# fields that say how a sweep runs, not what its runs train: a sweep resumes with other values of them
EXECUTION_FIELDS = ("workers",)


def config_differences(a: dict, b: dict, which=(), unordered=()) -> list[str]:
    """The fields in which two sweep configs (JSON dicts) differ in what their runs train: every field but
    EXECUTION_FIELDS and `which` (fields that choose which runs exist), `unordered` list fields compared as sets."""
    def seen(k: str, v: object) -> object:
        return sorted(v) if k in unordered and isinstance(v, list) else v
    skip = {*EXECUTION_FIELDS, *which}
    return sorted(k for k in set(a) | set(b) if k not in skip and seen(k, a.get(k)) != seen(k, b.get(k)))


def write_results(root: Path, results: list[dict]) -> None:
    with (root / "results.jsonl").open("w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")


def seeds_of(sweep) -> list[int]:
    """A sweep's seeds: `seeds` of them from its first, `seed` (`--seed`, `--seeds`)."""
    return list(range(sweep.seed, sweep.seed + sweep.seeds))


def seeds_phrase(seeds: list[int]) -> str:
    """`seed 0` or `seeds 0, 1 (mean, min–max)`: how a report's header names the seeds its cells fold."""
    many = len(seeds) > 1
    return f"seed{'s' if many else ''} {', '.join(map(str, seeds))}{' (mean, min–max)' if many else ''}"


def check_names(field: str, got, allowed) -> None:
    """A sweep's list of names (rules, models): non-empty, each one of `allowed`; else a ValueError naming the field."""
    if not got or any(x not in allowed for x in got):
        raise ValueError(f"{field}: expected names from {list(allowed)}, got {list(got)}")


def check_distinct(field: str, got, low: int, what: str) -> None:
    """A sweep's list of sizes: non-empty, distinct, each >= low; else a ValueError naming the field."""
    if not got or min(got) < low or len(set(got)) != len(got):
        raise ValueError(f"{field}: expected distinct {what} >= {low}, got {list(got)}")


def check_at_least_one(sweep, fields: tuple) -> None:
    """Each of a sweep's integer `fields` is >= 1; else a ValueError naming the first that is not."""
    for name in fields:
        if getattr(sweep, name) < 1:
            raise ValueError(f"{name}: expected >= 1, got {getattr(sweep, name)}")


def run_grid(kind: str, sweep, out: str | Path | None, *, jobs_for: Callable, run_one: Callable, report: Callable,
             plot: Callable, minutes: float | None = None, partial: bool = False, which: tuple[str, ...] = (),
             unordered: tuple[str, ...] = (), progress: Callable | None = None, first: Callable | None = None) -> Path:
    """Run (or resume) a lab's validated sweep (a dataclass) in `sweep_folder(kind, sweep, out)`: jobs_for(sweep,
    root) through run_jobs, then results.jsonl, table.md = report(sweep, results) and plot(sweep, results,
    root / "<kind>.png"); prints the table; returns root. `minutes`: a timed piece (with_deadline) — when runs are
    left, nothing but their own folders is written and the message says how to continue; with `partial` (a lab whose
    report shows — for a cell short of a seed's run), also partial_table.md: the report of the runs finished so far,
    headed as partial (gone once the sweep finishes), and after it progress(sweep, the jobs left) where given (a lab
    whose runs finish in parts: pairs' ladders). `which`, `unordered`: sweep_folder's; `first`: run_jobs'."""
    check_minutes(minutes)
    root = sweep_folder(kind, sweep, out, which=which, unordered=unordered)
    jobs = with_deadline(jobs_for(sweep, root), minutes)
    print(f"{kind} sweep: {len(jobs)} runs -> {root}")
    outs = run_jobs(run_one, jobs, workers=sweep.workers, desc=kind, first=first)
    left = sum(r is None for r in outs)
    results = [r for r in outs if r is not None]
    if left:
        said = stopped_message(minutes, jobs, left, root)
        if partial:
            head = (f"Partial: {len(results)} of {len(jobs)} runs finished; — = a cell not known yet (it waits for "
                    "every seed's run).")
            more = "" if progress is None else "\n" + progress(sweep, [j for j, r in zip(jobs, outs) if r is None]) + "\n"
            (root / "partial_table.md").write_text(f"{head}\n\n{report(sweep, results)}\n{more}")
            said += f"; the cells known so far are in {root / 'partial_table.md'}"
        print(said)
        return root
    (root / "partial_table.md").unlink(missing_ok=True)
    write_results(root, results)
    table = report(sweep, results)
    (root / "table.md").write_text(table + "\n")
    png = plot(sweep, results, root / f"{kind}.png")
    print(f"\n{table}\n\nwrote {root / 'table.md'}, {png}")
    return root
