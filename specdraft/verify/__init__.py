"""Turning target outputs into emitted tokens: the shared sampling rules and the two verifiers."""

from specdraft.verify.greedy import greedy_verify
from specdraft.verify.rejection import one_hot_probs, pad_vocab, rejection_verify
from specdraft.verify.sampling import InvalidParameterError, SamplingParams, logits_to_probs, sample

__all__ = [
    "InvalidParameterError",
    "SamplingParams",
    "greedy_verify",
    "logits_to_probs",
    "one_hot_probs",
    "pad_vocab",
    "rejection_verify",
    "sample",
]
