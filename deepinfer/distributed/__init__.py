"""Multi-device foundation over torch.distributed (gloo on CPU, NCCL on CUDA): rank layout (layout.py),
process groups and backends (backend.py), worker processes with failure detection (launcher.py), and
expert-parallel dispatch/combine (moe_comm.py). The engine does not use it yet."""
