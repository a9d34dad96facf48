"""Medusa-1 heads (Cai et al. 2024) on the target's last hidden state, with one shared, reduced readout.

Head k (k = 1 .. K) reads the target's final-normed hidden state h_t of the newest position whose features
the target has computed and guesses the token k + 1 places after it:

    z_k = h_t + SiLU(W_k h_t + b_k)        one residual block per head, zero-initialised (z_k = h_t)
    p_k = softmax(lm_head(z_k))            a readout shared by the heads, over the draft vocabulary

With the context c_0 .. c_{n-1} ending in the pending token c_{n-1} (the target's own next token, scored in
the next verification), features are known up to position n-2, so head k guesses c_{n-1+k}: head 1 the
first draft token, head K the K-th. The readout is shared and restricted to the N most frequent target
tokens (EAGLE-3's d2t / t2d maps, so unseen target ids are never drafted): K heads cost K small products and
one readout of K rows per round, and the weights stay small (SmolLM2-135M, K = 4, N = 8192: 6M parameters).

Proposals need no draft forward per token: every head guesses from the same h_t, so a chain is each head's
best token and a tree is the best `max_nodes` nodes of the heads' top-k choices combined (Medusa's "tree of
choices", scored by the product of the heads' probabilities), at the cost of one head forward per round.
Proposals are deterministic (one-hot draft distributions), so verification is lossless at any temperature.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdraft.drafters.base import ROOT, DraftRequest, Proposal, Verified
from specdraft.drafters.tree_growth import TreeNode, add_children, best_tree, next_frontier
from specdraft.errors import SpecdraftError
from specdraft.runtime.model import Linear, Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FINAL = -1  # the target's final-normed hidden state, as Drafter.hidden_layers names it


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_heads: int
    target: dict[str, Any] = field(default_factory=dict)  # what the heads were trained for

    def to_dict(self) -> dict[str, Any]:
        return {"architectures": ["MedusaModel"], "medusa_num_heads": self.num_heads, "medusa_num_layers": 1,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "shared_lm_head": True,
                "specdraft": {"format": 1, "target": self.target}}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MedusaConfig:
        try:
            if int(raw.get("medusa_num_layers", 1)) != 1:
                raise SpecdraftError("only Medusa heads of one residual block are supported")
            return cls(int(raw["hidden_size"]), int(raw["vocab_size"]), int(raw["draft_vocab_size"]),
                       int(raw["medusa_num_heads"]), dict(raw.get("specdraft", {}).get("target", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecdraftError(f"not a Medusa head config (missing or bad {exc})") from exc


class MedusaHeads(nn.Module):
    """K residual blocks and the shared readout; `forward` maps hidden states [..., dim] to draft logits
    [..., K, draft_vocab]."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.medusa = config
        dim = config.hidden_size
        # The runtime's Linear: bf16 rows run in the fused C kernels (torch's CPU bf16 products are several
        # times slower than a whole target step where bf16 is not native).
        self.blocks = nn.ModuleList(Linear(dim, dim) for _ in range(config.num_heads))
        self.lm_head = Linear(dim, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size))
        self.set_draft_vocab(torch.arange(min(config.draft_vocab_size, config.vocab_size)))

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary as target ids (stored sorted)."""
        ids = torch.sort(torch.as_tensor(target_ids, dtype=torch.long).unique()).values
        if len(ids) != self.medusa.draft_vocab_size:
            raise ValueError(f"{len(ids)} distinct draft tokens for a draft vocabulary of "
                             f"{self.medusa.draft_vocab_size}")
        self.draft_to_target.copy_(ids)
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def init_from_target(self, target: Transformer) -> MedusaHeads:
        """Zero blocks (each head starts as the target's own readout of h_t) and the target's readout rows."""
        with torch.no_grad():
            for block in self.blocks:
                block.weight.zero_()
                block.bias.zero_()
            self.lm_head.weight.copy_(target.lm_head.weight[self.draft_to_target].float())
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.to(self.lm_head.weight.dtype)
        z = torch.stack([h + torch.nn.functional.silu(block(h)) for block in self.blocks], dim=-2)
        return self.lm_head(z)

    def check_target(self, target: Transformer) -> None:
        cfg = target.config
        if (cfg.hidden_size, cfg.vocab_size) != (self.medusa.hidden_size, self.medusa.vocab_size):
            raise SpecdraftError(
                f"Medusa heads were made for hidden size {self.medusa.hidden_size} / vocab {self.medusa.vocab_size},"
                f" the target has {cfg.hidden_size} / {cfg.vocab_size}")

    def save(self, path: str | Path, dtype: torch.dtype | None = None) -> Path:
        """config.json + model.safetensors (Medusa's tensor names, the shared readout as lm_head); weights
        in `dtype` (default: as they are; bf16 halves the files of heads trained in fp32)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(self.medusa.to_dict(), indent=2) + "\n")
        tensors = {"lm_head.weight": self.lm_head.weight, "d2t": self.d2t, "t2d": self.t2d}
        for k, block in enumerate(self.blocks):
            tensors[f"medusa_head.{k}.0.linear.weight"] = block.weight
            tensors[f"medusa_head.{k}.0.linear.bias"] = block.bias
        save_file({k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous()
                   .clone() for k, v in tensors.items()}, str(path / WEIGHTS_FILE))
        return path

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> MedusaHeads:
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise SpecdraftError(f"{path} is not a Medusa head directory ({CONFIG_FILE} + {WEIGHTS_FILE})")
        try:
            raw = json.loads((path / CONFIG_FILE).read_text())
        except json.JSONDecodeError as exc:
            raise SpecdraftError(f"{path / CONFIG_FILE} is not valid JSON: {exc}") from exc
        heads = cls(MedusaConfig.from_dict(raw))
        state = load_file(str(path / WEIGHTS_FILE))
        try:
            with torch.no_grad():
                heads.lm_head.weight.copy_(state["lm_head.weight"].float())
                for k, block in enumerate(heads.blocks):
                    block.weight.copy_(state[f"medusa_head.{k}.0.linear.weight"].float())
                    block.bias.copy_(state[f"medusa_head.{k}.0.linear.bias"].float())
            heads.set_draft_vocab(torch.arange(heads.medusa.draft_vocab_size) + state["d2t"].long())
        except (KeyError, RuntimeError) as exc:
            raise SpecdraftError(f"Medusa head weights in {path} do not match its config: {exc}") from exc
        heads.requires_grad_(False)
        return heads.to(dtype).eval()


class MedusaDrafter:
    """Drafts with Medusa heads on the target's final hidden state (see the module docstring)."""

    hidden_layers = (FINAL,)

    def __init__(self, heads: MedusaHeads, target: Transformer, name: str = "medusa") -> None:
        heads.check_target(target)
        self.heads = heads.to(dtype=target.dtype).eval()
        self.heads.requires_grad_(False)
        self.name = name
        self._last: dict[int, torch.Tensor] = {}  # request id -> h_t of the newest position with features

    def add_request(self, request: DraftRequest) -> None:
        if FINAL not in request.prompt_hidden:
            raise SpecdraftError(f"the engine did not pass the target's final hidden states to {self.name!r}")
        self._last[request.request_id] = request.prompt_hidden[FINAL][-1].clone()

    def remove_request(self, request_id: int) -> None:
        self._last.pop(request_id, None)

    def observe(self, request_id: int, verified: Verified) -> None:
        if FINAL not in verified.hidden:
            raise SpecdraftError(f"{self.name!r} needs the target's hidden states in every verified round")
        row = 1 + verified.accepted[-1] if verified.accepted else 0
        self._last[request_id] = verified.hidden[FINAL][row].clone()

    def propose(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]], max_ks: Sequence[int],
                max_nodes: Sequence[int] | None = None) -> list[Proposal]:
        nodes = list(max_nodes) if max_nodes is not None else list(max_ks)
        out = [Proposal([]) for _ in request_ids]
        rows = [i for i, k in enumerate(max_ks) if k > 0]
        if not rows:
            return out
        with torch.inference_mode():
            logits = self.heads(torch.stack([self._last[request_ids[i]] for i in rows]))  # [R, K, V']
            log_probs = torch.log_softmax(logits.float(), dim=-1)
        to_target = self.heads.draft_to_target.tolist()
        depth_limit = self.heads.medusa.num_heads
        for r, i in enumerate(rows):
            depth = min(max_ks[i], depth_limit)
            if nodes[i] <= max_ks[i]:  # a chain: each head's best token
                best = log_probs[r, :depth].argmax(-1).tolist()
                out[i] = Proposal([to_target[t] for t in best])
            else:
                out[i] = _tree_of_choices(log_probs[r, :depth], nodes[i], to_target)
        return out


def _tree_of_choices(log_probs: torch.Tensor, max_nodes: int, to_target: list[int]) -> Proposal:
    """The best `max_nodes` nodes of the heads' top-k choices combined, level by level: the nodes of depth d
    are the best-scored of depth d - 1 (at most TREE_BEAM of them) times head d's top-k tokens."""
    candidates: list[TreeNode] = []
    frontier = [ROOT]
    for level in range(1, log_probs.shape[0] + 1):
        for parent in frontier:
            add_children(candidates, parent, log_probs[level - 1], level, max_nodes, to_target.__getitem__)
        frontier = next_frontier(candidates, level)
    return best_tree(candidates, max_nodes)


def make_medusa_drafter(path: str, target: Transformer, name: str | None = None) -> MedusaDrafter:
    return MedusaDrafter(MedusaHeads.load(path), target, name=name or f"medusa:{path}")


__all__ = ["MedusaConfig", "MedusaDrafter", "MedusaHeads", "make_medusa_drafter"]
