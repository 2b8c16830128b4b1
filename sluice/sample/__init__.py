"""Token sampling, below both the model runner and speculative decoding: the `Sampler` (torch
path, the CPU reference), its fused Triton kernels, the per-row mask functions the rejection
sampler shares, and `SamplingMetadata`, the batch of settings either is handed."""
