"""What a rank holds: its RankState (rank_state.py), the disk tier (disk.py), the optimizers
over its shards (sharded_optimizer.py, whole_params.py, optimizer.py), state dicts under the
plain model's names (plain_state.py), checkpoints (checkpoint.py), the memory report
(memory_report.py)."""
