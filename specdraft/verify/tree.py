"""Verification of a token tree: the target scores every node in one forward, and the verifier walks down
from the root, keeping the longest path the target agrees with.

Layout shared with the engine: a tree of N draft nodes is scored as N + 1 rows, row 0 the pending token (the
root, the last committed token) and row 1 + i node i. `target[0]` is the target's output after the root and
`target[1 + i]` its output after node i, so a node's children are judged by its own row.

Greedy: at each node accept the child whose token is the target's argmax there; stop when none is, and emit
the argmax. That is plain greedy decoding, token for token.

Sampling (multi-candidate speculative sampling, SpecInfer, Miao et al. 2024; as in EAGLE): at a node with
residual target distribution p (at first the target's distribution there), try its children in order; child
x, drawn from q (its row of `draft_probs`, one-hot on x when the drafter is deterministic), is accepted with
probability min(1, p(x) / q(x)); on rejection p becomes norm(max(0, p - q)) and the next sibling is tried;
if every child is rejected the token is drawn from the residual. The emitted token is distributed exactly as
p whatever q is, provided each sibling was drawn from its q given the earlier siblings (by the single-step
rejection lemma, applied once per sibling). That covers children sampled independently from one q, children
sampled without replacement (q with the earlier siblings removed and renormalised), and deterministic top-k
children (one-hot q: rejecting x just removes x from p). After an accepted child the walk continues below it
with the target's distribution at that child.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdraft.verify.greedy import argmax
from specdraft.verify.sampling import sample

# Parent index of a node that hangs directly after the last committed token (the root).
ROOT = -1


def tree_depths(parents: Sequence[int]) -> list[int]:
    """1-based depth of each node (children of ROOT have depth 1); parents precede their children."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p == ROOT else depths[p] + 1)
    return depths


def tree_attention_mask(parents: Sequence[int]) -> torch.Tensor:
    """bool [N + 1, N + 1] over (root, nodes): row r may see row c iff c is r or one of its ancestors (the
    root is everyone's ancestor). A chain gives the causal (lower-triangular) mask."""
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        row = 1 + i
        if p != ROOT:
            mask[row] = mask[1 + p]
        mask[row, row] = True
    return mask


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """Node -> its children in proposal order (ROOT's too)."""
    children: dict[int, list[int]] = {ROOT: []}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
        children.setdefault(i, [])
    return children


def greedy_tree_verify(tokens: Sequence[int], parents: Sequence[int],
                       target_logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Accept the longest root-to-node path whose every token is the target's argmax after its parent.

    target_logits [N + 1, V] (rows as in the module docstring). Returns (accepted node indices, root first;
    tokens to emit: the accepted tokens, then the target's argmax after the last accepted node)."""
    _check(tokens, parents, target_logits)
    return greedy_tree_walk(tokens, parents, argmax(target_logits).tolist())


def greedy_tree_walk(tokens: Sequence[int], parents: Sequence[int],
                     target_argmax: Sequence[int]) -> tuple[list[int], list[int]]:
    """`greedy_tree_verify` given the target's argmax of each of its N + 1 rows instead of the logits."""
    _check_tree(tokens, parents)
    if len(target_argmax) < len(tokens) + 1:
        raise ValueError(f"{len(target_argmax)} target argmaxes for a tree of {len(tokens)} nodes (need one more)")
    children = children_of(parents)
    node, path = ROOT, []
    while True:
        want = target_argmax[1 + node]
        match = next((c for c in children[node] if tokens[c] == want), None)
        if match is None:
            return path, [tokens[i] for i in path] + [want]
        path.append(match)
        node = match


def tree_rejection_verify(tokens: Sequence[int], parents: Sequence[int], draft_probs: torch.Tensor | None,
                          target_probs: torch.Tensor,
                          generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """Multi-candidate rejection sampling down the tree; lossless with respect to `target_probs`.

    draft_probs [N, V] (the target's vocab; see `pad_vocab`): row i the distribution node i was drawn from
    given its parent and earlier siblings, or None for a deterministic drafter (one-hot rows).
    target_probs [N + 1, V]: final distributions (after temperature / top-k / top-p). Randomness comes only
    from `generator`: one uniform per child tried, then one `sample` call. Returns (accepted node indices,
    tokens to emit), as `greedy_tree_verify`."""
    _check(tokens, parents, target_probs)
    if draft_probs is not None and tuple(draft_probs.shape) != (len(tokens), target_probs.shape[-1]):
        raise ValueError(f"draft_probs must be [N, V] = [{len(tokens)}, {target_probs.shape[-1]}], "
                         f"got {tuple(draft_probs.shape)}")
    vocab = target_probs.shape[-1]
    children = children_of(parents)
    node, path = ROOT, []
    residual = target_probs[0].float()
    while True:
        accepted = None
        for child in children[node]:
            token = tokens[child]
            p_token = float(residual[token]) if 0 <= token < vocab else 0.0
            if draft_probs is None:
                q_token = 1.0
            else:
                q_token = float(draft_probs[child, token]) if 0 <= token < vocab else 0.0
            # u < p/q without the division (no 0/0 for a token q could not have drawn); p == q accepts surely.
            if float(torch.rand((), generator=generator)) * q_token < p_token:
                accepted = child
                break
            residual = _reject(residual, token, None if draft_probs is None else draft_probs[child])
        if accepted is None:
            emitted = int(sample(residual, generator=generator))
            return path, [tokens[i] for i in path] + [emitted]
        path.append(accepted)
        node = accepted
        residual = target_probs[1 + node].float()


def _reject(residual: torch.Tensor, token: int, draft_row: torch.Tensor | None) -> torch.Tensor:
    """norm(max(0, p - q)) after rejecting `token` drawn from q (one-hot on it when `draft_row` is None)."""
    if draft_row is None:
        out = residual.clone()
        if 0 <= token < out.shape[0]:
            out[token] = 0.0
    else:
        out = (residual - draft_row.float()).clamp_min(0.0)
    total = out.sum()
    # An all-zero residual means p <= q everywhere, i.e. p == q up to rounding, so the rejection itself was a
    # rounding artefact; p is then still the right law.
    if total <= 0.0:
        return residual
    return out / total


def _check(tokens: Sequence[int], parents: Sequence[int], target: torch.Tensor) -> None:
    _check_tree(tokens, parents)
    if target.dim() != 2 or target.shape[0] != len(tokens) + 1:
        raise ValueError(f"target rows must be [N + 1, V] = [{len(tokens) + 1}, V], got {tuple(target.shape)}")


def _check_tree(tokens: Sequence[int], parents: Sequence[int]) -> None:
    if len(tokens) != len(parents):
        raise ValueError(f"{len(tokens)} tree tokens but {len(parents)} parents")
    if any(not ROOT <= p < i for i, p in enumerate(parents)):
        raise ValueError(f"parents must point to an earlier node or ROOT, got {list(parents)}")
