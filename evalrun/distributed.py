"""The torchrun world a process belongs to, and which part of the work it does.

evalrun never launches ranks itself: `torchrun --nproc-per-node N -m evalrun ...` does (multi-node
through torchrun's rendezvous), and this module reads its environment (RANK, WORLD_SIZE, LOCAL_RANK).
Two uses of a world of W > 1 ranks:
  tensor_parallel == W   the ranks split one model (engine/tensor_parallel.py)
  tensor_parallel == 1   the ranks split the prompt set, batch by batch (`shard_batches`); rank 0
                         gathers every rank's results and alone writes the store
`--shard I/N` splits the same way without torch.distributed (CI matrix jobs, Slurm arrays): each job
writes its own store, `evalrun store merge` joins them.

The process group is nccl on GPU and gloo on CPU; results travel between ranks on a gloo group as
bytes (a SQLite store file, never pickle), so a GPU run needs no CPU copies through NCCL.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import sys
from dataclasses import dataclass

from .errors import ConfigError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
TIMEOUT = datetime.timedelta(minutes=30)  # a rank this late is gone; gloo's default is the same


@dataclass(frozen=True)
class Shard:
    """Part `index` of `count` (0-based): the batches of the plan whose number is `index` mod `count`."""

    index: int = 0
    count: int = 1

    @property
    def whole(self) -> bool:
        return self.count == 1

    def label(self) -> str:
        return f"{self.index}/{self.count}"

    def as_dict(self) -> dict[str, int]:
        return {"index": self.index, "count": self.count}


def parse_shard(text: str) -> Shard:
    """'1/4' -> Shard(1, 4); ConfigError (one line) otherwise."""
    match = re.fullmatch(r"\s*(\d{1,4})\s*/\s*(\d{1,4})\s*", str(text))
    if not match or not 0 <= int(match.group(1)) < int(match.group(2)):
        raise ConfigError(f"--shard {text!r} is not valid; use I/N with 0 <= I < N, e.g. --shard 0/4")
    return Shard(int(match.group(1)), int(match.group(2)))


def shard_batches(batch_count: int, shard: Shard) -> list[int]:
    """Batch numbers of a plan of `batch_count` batches that `shard` runs (round robin: long and short
    prompts spread over the shards). Whole batches, so every prompt keeps its batch companions and bits."""
    return list(range(shard.index, batch_count, shard.count))


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def leader(self) -> bool:
        """The rank that writes stores and goldens and prints the outcome."""
        return self.rank == 0


def world() -> World:
    """This process's place in the torchrun world (a world of one outside torchrun)."""
    try:
        values = [int(os.environ.get(name, default)) for name, default in zip(TORCHRUN_ENV, ("0", "1", "0"))]
    except ValueError:
        raise ConfigError(f"RANK/WORLD_SIZE/LOCAL_RANK are not integers ({', '.join(os.environ.get(n, '') for n in TORCHRUN_ENV)}); "
                          "launch with torchrun, or unset them") from None
    rank, size, local_rank = values
    if size < 1 or not 0 <= rank < size or local_rank < 0:
        raise ConfigError(f"RANK={rank} WORLD_SIZE={size} LOCAL_RANK={local_rank} is not a torchrun world (0 <= RANK "
                          "< WORLD_SIZE); launch with torchrun, or unset them")
    return World(*values)


def check_world(tensor_parallel: int, shard: Shard | None = None) -> None:
    """ConfigError (one line) unless the launch fits the request: tensor_parallel N needs exactly N
    torchrun ranks; --shard and a torchrun world of data-parallel ranks do not mix."""
    here = world()
    if tensor_parallel > 1 and here.size != tensor_parallel:
        launched = f"this process is one of {here.size} ranks" if here.distributed else "this is a single process"
        raise ConfigError(f"tensor_parallel={tensor_parallel} needs {tensor_parallel} ranks and {launched}; launch "
                          f"with `torchrun --nproc-per-node {tensor_parallel} -m evalrun ... --tensor-parallel "
                          f"{tensor_parallel}`")
    if shard is not None and not shard.whole and here.distributed:
        raise ConfigError("--shard splits the work between separate jobs; under torchrun the ranks split it "
                          "already: drop --shard or launch without torchrun")


_STATE: dict[str, object] = {}


def join(device: str) -> World:
    """Join the torchrun process group once per process (nccl on GPU, gloo on CPU) and pin this rank's
    GPU (cuda = cuda:LOCAL_RANK); a world of one joins nothing."""
    here = world()
    if not here.distributed or "group" in _STATE:
        return here
    import torch
    import torch.distributed as dist

    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(here.local_rank)
            dist.init_process_group("nccl", timeout=TIMEOUT, device_id=torch.device("cuda", here.local_rank))
        else:
            dist.init_process_group("gloo", timeout=TIMEOUT)
    except ValueError as error:  # RANK/WORLD_SIZE set without the rest of torchrun's environment (MASTER_ADDR ...)
        raise ConfigError(f"RANK={here.rank} WORLD_SIZE={here.size} ask for a torchrun world, but torch.distributed "
                          f"cannot join it ({str(error).splitlines()[0][:160]}); launch with torchrun, or unset "
                          "them") from None
    _STATE["group"] = dist.group.WORLD
    _STATE["bytes_group"] = dist.new_group(backend="gloo", timeout=TIMEOUT)
    signal.signal(signal.SIGTERM, _terminated)  # torchrun stops the other ranks with SIGTERM when one dies
    return here


class RankInterrupted(KeyboardInterrupt):
    """This rank was stopped (SIGTERM from torchrun when another rank died) or a collective found a
    rank gone: the run it was making is interrupted, never complete."""


def _terminated(signum, frame) -> None:
    raise RankInterrupted(f"rank {world().rank} of {world().size} stopped by signal {signum} (another rank died?)")


def model_group():
    """The process group tensor parallelism reduces over (the whole world)."""
    return _STATE["group"]


def gather_bytes(data: bytes) -> list[bytes] | None:
    """Every rank's `data` on rank 0 (in rank order), None on the others; a rank gone -> RankInterrupted."""
    here = world()
    if not here.distributed:
        return [data]
    import torch
    import torch.distributed as dist

    group = _STATE["bytes_group"]
    try:
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(here.size)]
        dist.all_gather(sizes, size, group=group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else padded[:0]
        chunks = [torch.zeros(longest, dtype=torch.uint8) for _ in range(here.size)] if here.leader else None
        dist.gather(padded, chunks, dst=0, group=group)
    except (RuntimeError, dist.DistBackendError) as error:
        raise RankInterrupted(f"rank {here.rank} of {here.size}: another rank is gone "
                              f"({str(error).splitlines()[0][:200]})") from None
    if not here.leader:
        return None
    return [bytes(chunk[:int(s.item())].numpy().tobytes()) for chunk, s in zip(chunks, sizes)]


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank (every rank must call it)."""
    here = world()
    if not here.distributed:
        return flag
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([int(flag)], dtype=torch.int64)
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_STATE["bytes_group"])
    except (RuntimeError, dist.DistBackendError) as error:
        raise RankInterrupted(f"rank {here.rank} of {here.size}: another rank is gone "
                              f"({str(error).splitlines()[0][:200]})") from None
    return bool(tensor.item())


def broadcast_int(value: int) -> int:
    """Rank 0's `value` on every rank (the verdict's exit code, so every rank exits alike)."""
    here = world()
    if not here.distributed:
        return value
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64)
    try:
        dist.broadcast(tensor, src=0, group=_STATE["bytes_group"])
    except (RuntimeError, dist.DistBackendError) as error:
        raise RankInterrupted(f"rank {here.rank}: rank 0 is gone ({str(error).splitlines()[0][:200]})") from None
    return int(tensor.item())


def leave(code: int) -> None:
    """End of the command under torchrun: leave the process group, so torchrun sees a clean exit.

    Over NCCL the process ends here, with `code`, without destructors: on two H200s an -O2 run (NCCL
    all-reduces inside CUDA graphs) finished and stored its results, then never exited, in
    `destroy_process_group` or the communicators' teardown at exit. Everything evalrun writes is
    committed or flushed before this point."""
    if "group" not in _STATE:
        return
    import torch.distributed as dist

    if dist.get_backend(_STATE["group"]) == "nccl":
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    if code == 0:  # after a failure another rank may be stuck in a collective: leave the group to the exit
        dist.destroy_process_group()
    _STATE.clear()
