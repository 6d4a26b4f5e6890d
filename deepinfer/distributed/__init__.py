"""Process groups and collectives over torch.distributed (gloo on CPU, NCCL on CUDA)."""
