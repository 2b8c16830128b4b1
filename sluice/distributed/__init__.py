"""Tensor parallelism: the process group and the collectives the parallel layers call
(sluice.distributed.tp), and how heads split over ranks (sluice.distributed.head_split, no
PyTorch). Import the modules themselves: this package imports nothing, so the API server can
check a tensor_parallel_size without loading PyTorch."""
