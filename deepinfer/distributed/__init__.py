"""Multi-device foundation over torch.distributed: rank layout (layout.py), process groups and backends
(backend.py), worker processes with failure detection (launcher.py). The engine does not use it yet."""
