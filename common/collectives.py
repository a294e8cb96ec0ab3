"""Decisions every rank takes together. Each function is a collective: call it on every rank, in the same
order, or the ranks deadlock. Without an initialised process group they answer for this process alone."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def ranks_where(condition: bool, device: torch.device | str = "cpu") -> list[int]:
    """The ranks on which `condition` holds (one all-reduce of a world-size vector)."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if _distributed() else (1, 0)
    flags = torch.zeros(world, device=device)
    flags[rank] = float(condition)
    if _distributed():
        dist.all_reduce(flags)
    return [r for r in range(world) if flags[r] > 0]


def any_rank(conditions: Sequence[bool], device: torch.device | str = "cpu") -> list[bool]:
    """For each condition, whether it holds on at least one rank (one all-reduce, MAX)."""
    flags = torch.tensor([float(c) for c in conditions], device=device)
    if _distributed():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(f > 0) for f in flags]


def on_main_process(check, catch: tuple[type[Exception], ...]):
    """Run `check()` on global rank 0 only; an exception of a type in `catch` raised there is raised again, with
    the same message, on every rank, so that all ranks stop together (a collective). Returns what `check`
    returned on rank 0, and None on the other ranks. Rank 0 raises its own error as it was (an OSError keeps its
    errno: a full disk is still exit 4); a type that cannot be rebuilt from its message is a RuntimeError elsewhere."""
    outcome, original = None, None
    if not _distributed() or dist.get_rank() == 0:
        try:
            outcome = check()
        except catch as error:
            original = error
    said = from_main_process(None if original is None else (type(original), str(original)))
    if original is not None:
        raise original
    if said is not None:
        error_type, message = said
        try:
            failure = error_type(message)
        except Exception:  # a type that takes other arguments
            failure = RuntimeError(f"{error_type.__name__}: {message}")
        raise failure
    return outcome


def from_main_process(value):
    """Global rank 0's `value`, on every rank (a collective)."""
    shared = [value]
    if _distributed():
        dist.broadcast_object_list(shared, src=0)
    return shared[0]


def on_every_rank(check, catch: tuple[type[Exception], ...]) -> None:
    """Run `check()` on every rank; the first error of a type in `catch` raised on any rank is raised again, with
    the same message, on every rank (a collective), so that all ranks stop together."""
    failure = None
    try:
        check()
    except catch as error:
        failure = (type(error), str(error))
    failures = [failure]
    if _distributed():
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    for found in failures:
        if found is not None:
            error_type, message = found
            raise error_type(message)


def main_process_view(read):
    """`read()` on global rank 0, its answer on every rank (a collective). For decisions made from the file system
    that are followed by a collective on some branches only: a node whose network file system lags (attribute
    caching after a requeue) would otherwise take the other branch and leave the rest waiting. An error `read` meets
    on rank 0 is raised on every rank."""
    return from_main_process(on_main_process(read, catch=(Exception,)))


def smallest_on_any_rank(value: int, device: torch.device | str = "cpu") -> int:
    """The smallest of the ranks' `value`s, on every rank (one all-reduce, MIN)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    if _distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def disagreements(values: dict[str, str | None]) -> list[str]:
    """For each key whose value differs between the ranks, a line naming the ranks, their hosts and both values; the
    same list on every rank (a collective). For inputs each rank reads itself from its node's file system."""
    import socket

    if not _distributed():
        return []
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (socket.gethostname(), values))
    said = []
    for key, reference in every[0][1].items():
        odd = [rank for rank, (_, seen) in enumerate(every) if seen.get(key) != reference]
        if odd:
            hosts = sorted({every[rank][0] for rank in odd})
            said.append(f"{key}: rank 0 ({every[0][0]}) has {reference}, rank(s) {odd} ({', '.join(hosts)}) have "
                        f"{every[odd[0]][1].get(key)}")  # fmt: skip
    return said
