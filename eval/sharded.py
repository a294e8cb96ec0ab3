"""lm-eval split over the ranks of a ZeRO-3 run: each rank scores its share of the documents, every rank takes part in
every forward pass.

lm-eval's `evaluate()` already deals documents out by rank (`doc_id % world_size == rank`), pads the request lists to
equal length and gathers the metrics to rank 0, given an LM that says its rank and world size and can all-gather,
gather objects and wait at a barrier (`ShardedLM` does, over torch.distributed). Under ZeRO-3 that is not enough:
every forward pass all-gathers the sharded weights, so every rank must run the same number of forward passes, and
lm-eval's batch counts differ between ranks (MMLU's four answers share one forward per context; a rank with fewer
distinct contexts runs fewer batches). So before its first forward each rank all-reduces its batch count and, after
its own batches, runs one-token dummy forwards (and one-token dummy generations, which `synced_gpus` keeps stepping
while another rank still generates) up to the largest count.

A failure on one rank (a document its filters or metrics cannot take, say) used to leave the others waiting forever in
lm-eval's next collective. Every collective here starts with an agreement on each rank's state: the failed rank meets
the others' next agreement with its failure, every rank leaves lm-eval, and the in-loop code logs it and trains on.
The same agreement before every forward pass carries a stop signal. (A rank that fails inside a forward pass, in
the middle of ZeRO-3's own gathers, cannot be met this way: the hang watchdog ends that.)

Fewer documents than ranks (a small subject file, `eval_limit` below the world size): lm-eval's split assumes every
rank holds a document of every task (it indexes a task's first request, and rank 0 reads every metric from every
rank's scores), so a rank with none used to stop in an error while rank 0 waited in the gather of scores, forever.
Such a rank scores the task's first document as a stand-in, taking part in every step, and sends empty scores for it
(`ShardedLM.gather_object`): the results are those of the documents once each.

Few-shot prompts: lm-eval draws GSM8K's examples from one seeded stream, consumed document by document, so a rank
that builds only its own documents' prompts draws other examples than one process would. `same_prompts_as_one_rank`
makes every rank build the one-process requests and keep its share, so the prompts and the scores are those of a
single-process evaluation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools

import torch
import torch.distributed as dist
from lm_eval.models.utils import Collator

from eval.agreement import FAILED, RUNNING, STOPPING, FailedOnAnotherRank, most_on_any_rank


class ShardedLM:
    """Mixed into an HFLM subclass (`sharded_lm_class`): rank `rank` of `world_size` ranks that share one ZeRO-3
    model."""

    def __init__(self, *args, rank: int, world_size: int, **kwargs):
        super().__init__(*args, **kwargs)  # a live model: HFLM takes the model's device and says rank 0 of 1
        self._rank, self._world_size = rank, world_size
        self.dummy_forwards = 0  # padding forwards this rank ran, for tests and logs
        self.stand_in_tasks: set[str] = set()  # tasks this rank scores a stand-in document of (filled below)

    def agree(self, state: int = RUNNING) -> int:
        """The worst state of any rank. Every collective of this class starts with it, so a rank whose evaluation
        failed between two of them (`announce_failure`) meets the others at their next one, and every rank leaves
        lm-eval (`FailedOnAnotherRank`) instead of waiting forever for it."""
        worst = most_on_any_rank(state, self.device)
        if worst == FAILED and state != FAILED:
            raise FailedOnAnotherRank("the benchmarks failed on another rank")
        return worst

    def announce_failure(self) -> None:
        """On the rank whose evaluation raised: meet the others' next collective with the failure."""
        self.agree(FAILED)

    def finish(self) -> None:
        """After lm-eval returns, on every rank: where a rank failed after the last collective (rank 0 alone
        aggregates the scores), the others learn it here."""
        self.agree()

    def all_gather(self, tensor):
        self.agree()
        pieces = [torch.zeros_like(tensor.reshape(1)) for _ in range(self.world_size)]
        dist.all_gather(pieces, tensor.reshape(1))
        return torch.cat(pieces)

    def barrier(self):
        self.agree()
        dist.barrier()

    def _agreed(self, flag: bool) -> bool:
        # every rank asks before the same forward pass (their counts are matched), so all stop at the same one
        return self.agree(STOPPING if flag else RUNNING) == STOPPING

    def gather_object(self, obj, dst=0):
        self.agree()
        # lm-eval gathers {task: [logged samples]} and {task: {(metric, filter): [values]}}; a stand-in task's
        # entries go empty, their keys kept (rank 0 reads every key it has from every rank)
        if isinstance(obj, dict):
            obj = {task: (({key: [] for key in value} if isinstance(value, dict) else [])
                          if task in self.stand_in_tasks else value) for task, value in obj.items()}  # fmt: skip
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        # the batches lm-eval will form: one per `batch_size` distinct contexts (its logits cache)
        group_by = "contexts" if self.backend == "causal" and self.logits_cache else None
        batches = Collator(requests, sort_fn=lambda r: 0, group_by=group_by, group_fn=lambda r: r[-2] + r[-1][:-1])
        mine = sum(1 for _ in batches.get_batched(n=self.batch_size))
        self.agree()
        most = most_on_any_rank(mine, self.device)  # before any forward: a collective between forwards hangs
        result = super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        for _ in range(most - mine):
            self._model_call(torch.full((1, 1), self.eot_token_id, device=self.device))
            self.dummy_forwards += 1
        return result

    def generate_until(self, requests, disable_tqdm: bool = False):
        calls = Collator([r.args for r in requests], sort_fn=lambda r: 0, group_by="gen_kwargs",
                         group_fn=lambda r: r[1])  # fmt: skip
        mine = sum(1 for _ in calls.get_batched(n=self.batch_size))
        self.agree()
        most = most_on_any_rank(mine, self.device)
        result = super().generate_until(requests, disable_tqdm=disable_tqdm)
        for _ in range(most - mine):
            context = torch.full((1, 1), self.eot_token_id, device=self.device)
            self._model_generate(context=context, attention_mask=torch.ones_like(context), max_length=2, stop=[])
            self.dummy_forwards += 1
        return result

    def _model_generate(self, context, max_length: int, stop, **generation_kwargs):
        # a rank that has finished keeps stepping until every rank has: each step is a gathered forward
        return super()._model_generate(context, max_length, stop, **{**generation_kwargs, "synced_gpus": True})


@functools.cache
def sharded_lm_class(base):
    """`base` (an HFLM subclass) with `ShardedLM`."""
    return type("ShardedLM", (ShardedLM, base), {})


@contextlib.contextmanager
def same_prompts_as_one_rank(rank: int, world_size: int, stand_in_tasks: set[str]):
    """While active, every lm-eval task builds the requests of a one-process evaluation (the same few-shot draws)
    and keeps those of its documents with `doc_id % world_size == rank`: the share `evaluate()` expects of it. A task
    with no document for this rank gets its first document as a stand-in, and its name in `stand_in_tasks`.

    The one-process requests of a task are built once and kept on the task (a full MMLU + GSM8K build takes ~30 s on
    every rank): later evaluations with the same settings get fresh copies of them."""
    from lm_eval.api.task import Task

    original_build, original_docs = Task.build_all_requests, Task.doc_iterator

    def build_all_requests(self, **kwargs):
        settings = {key: value for key, value in kwargs.items() if key not in ("rank", "world_size")}
        # the call's config too: a GSM8K request carries its generation_kwargs (max_gen_toks)
        key = (self.config.num_fewshot, repr(self.config.generation_kwargs), repr(sorted(settings.items())))
        kept = self.__dict__.setdefault("_one_rank_requests", {})
        if key not in kept:
            original_build(self, **settings, rank=0, world_size=1)
            kept[key] = self._instances
        mine = [instance for instance in kept[key] if instance.doc_id % world_size == rank]
        stand_in_tasks.discard(self.config.task)
        if not mine and kept[key]:
            mine = [instance for instance in kept[key] if instance.doc_id == kept[key][0].doc_id]
            stand_in_tasks.add(self.config.task)
        self._instances = [dataclasses.replace(instance, resps=[], filtered_resps={}) for instance in mine]

    def doc_iterator(self, *, rank: int = 0, limit=None, world_size: int = 1, samples=None):
        if self.config.task in stand_in_tasks:  # the stand-in's document, which lm-eval pairs with its requests
            return itertools.islice(original_docs(self, rank=0, limit=limit, world_size=1, samples=samples), 1)
        return original_docs(self, rank=rank, limit=limit, world_size=world_size, samples=samples)

    Task.build_all_requests, Task.doc_iterator = build_all_requests, doc_iterator
    try:
        yield
    finally:
        Task.build_all_requests, Task.doc_iterator = original_build, original_docs
