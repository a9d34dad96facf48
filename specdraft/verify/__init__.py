"""Turning target outputs into emitted tokens: the shared sampling rules and the verifiers (chains and
trees)."""

from specdraft.verify.greedy import greedy_verify
from specdraft.verify.rejection import one_hot_probs, pad_vocab, rejection_verify
from specdraft.verify.sampling import InvalidParameterError, SamplingParams, logits_to_probs, sample
from specdraft.verify.tree import ROOT, greedy_tree_verify, tree_attention_mask, tree_depths, tree_rejection_verify

__all__ = [
    "ROOT",
    "InvalidParameterError",
    "SamplingParams",
    "greedy_verify",
    "logits_to_probs",
    "one_hot_probs",
    "pad_vocab",
    "rejection_verify",
    "sample",
    "greedy_tree_verify",
    "tree_attention_mask",
    "tree_depths",
    "tree_rejection_verify",
]
