"""The model and its numerics: the one forward, the strict kernels' options, config, shapes, checkpoints, the
HLO audit, FLOPs. Imports only pallas_kernels (tests/test_layers.py)."""
