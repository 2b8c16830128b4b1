"""Speculative decoding: a proposer drafts k tokens, the target model scores them in one step,
and an exact rejection sampler decides how many to keep, so the output follows the target's
distribution (Leviathan et al., 2023)."""

# sluice.config imports this package's config at its end, which imports verify_positive from it:
# load sluice.config first, so either module may be imported first.
import sluice.config  # noqa: E402, F401
