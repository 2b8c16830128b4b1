"""Speculative decoding: a proposer drafts k tokens, the target model scores them in one step,
and an exact rejection sampler decides how many to keep, so the output follows the target's
distribution (Leviathan et al., 2023)."""
