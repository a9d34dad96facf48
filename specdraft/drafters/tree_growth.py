"""Growing draft trees EAGLE-2 style (Li et al. 2024), shared by the drafters that run a model.

The children of a node are the draft's top-k tokens there, scored by the draft's log-probability of the
whole path from the root; each step expands the best-scored nodes of the newest level in one forward (each
fed node sees the context and its ancestors among the nodes fed before, through the model's `branch_mask`),
and the best `max_nodes` nodes overall form the proposal. A path's score never exceeds its parent's, so the
best nodes always form a tree. The drafter supplies the forward; these functions keep the bookkeeping.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdraft.drafters.base import ROOT, Proposal

# Children per expanded node and nodes expanded per level (EAGLE-2 uses 10 and 10 on GPUs; on a CPU every
# expanded node is a row of the next draft forward).
TREE_TOP_K = 4
TREE_BEAM = 4


@dataclass
class TreeNode:
    token: int
    parent: int  # index into the candidate list, or ROOT
    depth: int
    score: float  # log draft probability of the path from the root


def add_children(nodes: list[TreeNode], parent: int, log_probs: torch.Tensor, depth: int, limit: int,
                 token_of: Callable[[int], int] = int) -> int:
    """Append the top min(TREE_TOP_K, limit) children of `parent` from its log-probabilities (skipping
    impossible tokens, which top-k / top-p leave); `token_of` maps a row index to a target token id.
    Returns how many were added."""
    base = 0.0 if parent == ROOT else nodes[parent].score
    top = torch.topk(log_probs, min(TREE_TOP_K, limit, log_probs.shape[-1]))
    added = 0
    for lp, index in zip(top.values.tolist(), top.indices.tolist()):
        if lp > float("-inf"):
            nodes.append(TreeNode(token_of(index), parent, depth, base + lp))
            added += 1
    return added


def next_frontier(nodes: list[TreeNode], depth: int) -> list[int]:
    """The TREE_BEAM best-scored nodes of one depth: the ones the next forward expands."""
    newest = [c for c, node in enumerate(nodes) if node.depth == depth]
    return heapq.nlargest(TREE_BEAM, newest, key=lambda c: nodes[c].score)


@dataclass
class LevelBlock:
    """One level's draft forward input, rows padded to the widest frontier: tokens and positions [B, W],
    and `branch_mask` [B, W, m] over the last m committed keys (the nodes fed before), None when m is 0."""

    tokens: torch.Tensor
    positions: torch.Tensor
    branch_mask: torch.Tensor | None
    tree_mask: torch.Tensor  # [W, W]: frontier nodes do not see each other


def level_block(nodes: Sequence[list[TreeNode]], frontiers: Sequence[list[int]], fed: Sequence[list[int]],
                bases: Sequence[int]) -> LevelBlock:
    """Lay out each request's frontier behind its `bases[b]`-token context: a node at depth d sits at position
    base + d - 1; `fed[b]` are the node indices whose keys follow the context, in order (older branch columns
    of a shorter request are its context, visible to all)."""
    width = max(len(f) for f in frontiers)
    branch = max(len(f) for f in fed)
    batch = len(frontiers)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    positions = torch.zeros(batch, width, dtype=torch.long)
    branch_mask = torch.ones(batch, width, branch, dtype=torch.bool)
    for b, (tree, front, done) in enumerate(zip(nodes, frontiers, fed)):
        for row, c in enumerate(front):
            tokens[b, row] = tree[c].token
            positions[b, row] = bases[b] + tree[c].depth - 1
            ancestors = set()
            a = tree[c].parent
            while a != ROOT:
                ancestors.add(a)
                a = tree[a].parent
            branch_mask[b, row, branch - len(done):] = torch.tensor([d in ancestors for d in done], dtype=torch.bool)
        positions[b, len(front):] = positions[b, max(len(front) - 1, 0)]
    return LevelBlock(tokens, positions, branch_mask if branch else None, torch.eye(width, dtype=torch.bool))


def best_tree(nodes: list[TreeNode], max_nodes: int) -> Proposal:
    """The `max_nodes` best-scored nodes as a proposal, parents first and siblings best first. A child's score
    is at most its parent's, and ties go to the shallower node, so every kept node's parent is kept too."""
    order = sorted(range(len(nodes)), key=lambda c: (-nodes[c].score, nodes[c].depth, c))
    keep = sorted(order[:max_nodes], key=lambda c: (nodes[c].depth, -nodes[c].score, c))
    index = {c: j for j, c in enumerate(keep)}
    kept = [c for c in keep if nodes[c].parent == ROOT or nodes[c].parent in index]
    index = {c: j for j, c in enumerate(kept)}
    return Proposal([nodes[c].token for c in kept], None,
                    [ROOT if nodes[c].parent == ROOT else index[nodes[c].parent] for c in kept])
