"""Entry point of a follower rank (`python -m servelm.worker.rank_main`, its RankLaunch pickled on
stdin): join the world, build this rank's shard and runner, run every step rank 0 sends."""

from __future__ import annotations

import logging
import pickle
import sys

import torch.distributed as dist

from servelm.models.loader import load_checkpoint
from servelm.worker.model_runner import ModelRunner
from servelm.worker.multi_rank import RankLaunch, build_shard, join_world, next_step, rank_device, receive_steps

logger = logging.getLogger("servelm.worker.rank_main")


def main() -> int:
    launch: RankLaunch = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {launch.rank} %(levelname)s %(message)s")
    config = launch.config
    device = rank_device(config, launch.rank)
    groups = join_world(config, launch.rank, launch.init_method, device)
    checkpoint = load_checkpoint(config.model.model, config.model.hf_overrides)
    shard = build_shard(config, checkpoint, groups, launch.num_blocks, device)
    runner = ModelRunner(
        shard.model, shard.kv_caches, config.cache.block_size * groups.cp.size, eos_token_ids=(), device=device,
        max_num_seqs=config.scheduler.max_num_seqs, max_model_len=launch.max_model_len,
    )  # fmt: skip
    pull = receive_steps(launch.step_address)
    logger.info("ready (tp %d/%d, cp %d/%d)", groups.tp.rank, groups.tp.size, groups.cp.rank, groups.cp.size)
    try:
        while (step := next_step(pull, launch.driver_pid)) is not None:
            runner.execute(step)
    except Exception:
        logger.exception("step failed on rank %d: exiting (rank 0 fails its requests)", launch.rank)
        return 1
    finally:
        pull.close(linger=0)
    groups.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
