"""The process of a tensor-parallel rank > 0: its shard of the model and KV heads, no scheduler. It
runs each forward rank 0 broadcasts (ModelRunner.follow) until rank 0 says stop, and dies with
its launcher; a lost peer fails its collective, so the process exits instead of waiting."""

from __future__ import annotations

import logging

from plait.runtime.distributed.place import RankPlace, join
from plait.runtime.server_args import ServerArgs


def run_rank_process(args: ServerArgs, addrs, place: RankPlace, ready) -> None:
    from plait.runtime.lifetime import die_with_parent
    from plait.runtime.model_executor.model_runner import ModelRunner

    die_with_parent(addrs.root)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[plait rank {place.rank}{f' dp {place.replica}' if args.dp_size > 1 else ''} "
                               "%(asctime)s] %(message)s")
    with ready.starting():
        runner = ModelRunner(args, progress=False, group=join(place))
    runner.follow()
    runner.group.close()
