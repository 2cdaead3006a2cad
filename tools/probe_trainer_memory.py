"""Device memory of the trainer's setup, stage by stage, and its pool's largest free piece.

    python tools/probe_trainer_memory.py [TRAIN FLAGS...]     # e.g. the gpt-1b flags of
                                                              # tools/gpu_common.sh's GPT1B_TRAIN

Builds what `jaxopt-train train` builds for the given flags (task, Trainer, compiled step),
then runs `--steps` steps, printing bytes in use, the allocator's peak, the allocator's largest
free block, the train state's own bytes and the compiled step's memory analysis after each stage.
Under a hard cap (`--memory-limit 16GiB`, or XLA_PYTHON_CLIENT_MEM_FRACTION) it shows what
besides the state is in the pool when the first step needs its temporaries in one buffer.
Twenty-third session: with a pool that grows on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false) the
largest free block was 0.9 GiB short of the free bytes (a buffer cannot span the pool's regions);
preallocated, the same step fitted. Writes nothing; on CPU the memory figures are absent.
"""

from __future__ import annotations

import sys


def _gib(x) -> str:
    return "n/a" if x is None else f"{x / 2**30:.3f} GiB"


def main(argv: list[str]) -> int:
    import jax

    from jaxopt_train.train.cli import apply_memory_limit, config_from_args
    from jaxopt_train.train.remat_search import build_fitting_run

    apply_memory_limit(argv)
    cfg = config_from_args(argv)
    device = jax.devices()[0]

    def report(stage, trainer=None):
        stats = device.memory_stats() or {}
        state = None if trainer is None else sum(
            shard.data.nbytes for leaf in jax.tree.leaves(trainer.state)
            for shard in leaf.addressable_shards if shard.device == device)
        print(f"[memory] {stage}: in use {_gib(stats.get('bytes_in_use'))}, peak "
              f"{_gib(stats.get('peak_bytes_in_use'))}, pool limit {_gib(stats.get('bytes_limit'))}, "
              f"largest free block {_gib(stats.get('largest_free_block_bytes'))}, "
              f"train state {_gib(state)}", flush=True)

    report("start")
    cfg, task, trainer, _ = build_fitting_run(cfg)  # --remat auto compiles while it chooses
    report("trainer built", trainer)
    if not trainer.compiled:
        trainer.compile(task.train_batch(0))
    print(f"[memory] compiled: {trainer.memory_report}", flush=True)
    report("compiled", trainer)
    for step in range(cfg.steps):
        metrics = trainer.step(task.train_batch(step))
        jax.block_until_ready(metrics)
        report(f"after step {step + 1}", trainer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
