"""What RL trains on: tasks, data files, rewards, multi-turn environments and tools. Imports nothing else of
rlkjax (tests/test_layers.py): a new reward, environment or tool lands here and touches nothing else."""
