"""EAGLE-3 draft head (Li et al. 2025) and the drafter that runs it, in vLLM's EAGLE-3 checkpoint layout.

The head is one decoder layer on top of the target's own features:

    g_t  = fc(concat(a_t^low, a_t^mid, a_t^high))          3*dim -> dim, the target's residual streams
    x_t  = concat(input_layernorm(embed(token_{t+1})), hidden_norm(g_t))     2*dim: q/k/v read both
    r_t  = g_t + o_proj(attention(x))                                        (RoPE at position t)
    h_t  = r_t + mlp(post_attention_layernorm(r_t))                          SwiGLU, the target's sizes
    p_t  = softmax(lm_head(norm(h_t)))        over the draft vocabulary; predicts token_{t+2}

The embedding is the target's (frozen, never stored). Draft id i is target id i + d2t[i]; t2d[v] says
whether target id v is in the draft vocabulary. Drafting beyond the verified context feeds the head's own
h_t (the layer's output before the final norm) in place of g_t, as EAGLE does.

The EAGLE-1 variant (`variant="eagle1"`, Li et al. 2024) reads one stream, the last layer's output a_t (the
target's feature before its final norm), with fc fixed to the identity (g_t = a_t), and the target's own final
norm and lm_head rows (frozen): it is trained to predict the target's next feature (h_t ~ a_{t+1}; smooth L1
on RMS-normalised vectors) as well as its next token, so the h_t it feeds back while drafting stands for a
feature the target would have computed. The drafter runs both variants the same way; only EAGLE-3 heads
export for vLLM. Measured on SmolLM2-135M with the same data and steps, EAGLE-3 agrees with the target more
(docs/results.md, stop 47).

Feature bookkeeping (per request). The committed context is c_0 .. c_{n-1}; the target has computed
features for c_0 .. c_{n-2} (c_{n-1} is the pending token, scored in the next verification). Head
position t pairs feature t with token t+1, so exactly the positions 0 .. n-2 can be fed from target
features, and position n-2's output drafts c_n. The head's KV cache (one layer, one slot per request) holds
only positions fed with target features: `propose` first feeds those it has not seen (the prompt at the
first proposal; later the pending token and accepted drafts of the last round, whose target features
`observe` stored), then drafts chain or tree positions behind them and rolls the cache back to the target-
feature part afterwards. Draft positions are never kept, because once verified their target features
replace the head's own hidden states; so rollback is one `commit` and there is nothing to undo in
`observe`, which only appends the rows of `Verified.hidden` whose tokens were committed: row 0 (the
pending token) and row 1+i for each accepted node i. Rounds in which nothing was drafted (plain fallback)
append row 0 alone, so the invariant "features known for all but the last context token" always holds.

`aux_layer_ids` in the config are vLLM's numbering (the residual stream *entering* layer i, as vLLM's
`eagle_aux_hidden_state_layer_ids`); the drafter's `hidden_layers` are ours (the stream *after* layer i),
so ours are vLLM's minus one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.drafters.base import ROOT, DraftRequest, Proposal, Verified
from specdraft.drafters.tree_growth import TREE_BEAM, TreeNode, add_children, best_tree, level_block, next_frontier
from specdraft.errors import SpecdraftError
from specdraft.runtime import cpu_kernels
from specdraft.runtime.config import ModelConfig
from specdraft.runtime.kv_cache import KEY_BLOCK, KVCache
from specdraft.runtime.model import (
    MLP,
    Attention,
    Linear,
    RMSNorm,
    Transformer,
    apply_rope,
    attention_masks,
    rope_inv_freq,
)
from specdraft.verify.sampling import SamplingParams, sample_rows

CONFIG_FILE = "config.json"
SPECULATORS_VERSION = "0.1.0"  # the speculators config layout the export follows
MAX_DRAFT_DEPTH = 64  # the engine's MAX_DRAFT_TOKENS
VARIANTS = {"eagle3": 3, "eagle1": 1}  # -> the target streams fc reads
WEIGHTS_FILE = "model.safetensors"


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default (2, L // 2, L - 3), clamped into 1 .. L-1 for small models (ids 1 .. L-1 enter layers
    1 .. L-1, i.e. leave layers 0 .. L-2; id 0 would be the embeddings)."""
    top = max(1, num_layers - 1)
    ids = [2, num_layers // 2, num_layers - 3] if num_layers >= 6 else [1, max(1, num_layers // 2), top]
    return [min(max(1, i), top) for i in ids]


@dataclass
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: list[int]  # vLLM numbering (see the module docstring)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    target: dict[str, Any] = field(default_factory=dict)  # what the head was trained for (name, fingerprint)
    variant: str = "eagle3"  # or "eagle1": one stream, the last layer's (see the module docstring)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise SpecdraftError(f"EAGLE head variant {self.variant!r}: choose from {', '.join(VARIANTS)}")
        if len(self.aux_layer_ids) != VARIANTS[self.variant]:
            raise SpecdraftError(f"an {self.variant} head reads {VARIANTS[self.variant]} target streams, not "
                                 f"{len(self.aux_layer_ids)} ({self.aux_layer_ids})")

    @classmethod
    def for_target(cls, target: Transformer, draft_vocab_size: int | None = None,
                   aux_layer_ids: Sequence[int] | None = None, variant: str = "eagle3",
                   **target_info: Any) -> EagleConfig:
        """A head's shape for this target. eagle3 reads vLLM's default streams, eagle1 the last layer's
        output (vLLM id L: the stream after the last layer)."""
        cfg = target.config
        default = [cfg.num_layers] if variant == "eagle1" else default_aux_layer_ids(cfg.num_layers)
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.vocab_size, min(draft_vocab_size or cfg.vocab_size, cfg.vocab_size),
                   list(aux_layer_ids or default), cfg.rms_norm_eps,
                   cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, dict(target_info), variant)

    @property
    def hidden_layers(self) -> list[int]:
        """Our capture indices (stream after layer i) of the three aux streams, in fc's input order."""
        return [i - 1 for i in self.aux_layer_ids]

    def model_config(self) -> ModelConfig:
        """A Llama-style config for the runtime's attention/MLP modules."""
        return ModelConfig.from_hf_dict({
            "model_type": "llama", "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False, "hidden_act": "silu"})

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json as EAGLE-3 checkpoints for vLLM spell it, plus our own keys under `specdraft`. An
        eagle1 head names an architecture of its own: no serving engine loads its layout."""
        architecture = "LlamaForCausalLMEagle3" if self.variant == "eagle3" else "SpecdraftEagle1Head"
        return {
            "architectures": [architecture], "model_type": "llama",
            "hidden_size": self.hidden_size, "target_hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)},
            "specdraft": {"format": 1, "target": self.target, "variant": self.variant},
        }

    def to_speculators_dict(self, verifier: str, verifier_architectures: Sequence[str] = (),
                            speculative_tokens: int = 3) -> dict[str, Any]:
        """config.json in the speculators format (`speculators_model_type: "eagle3"`), which vLLM and SGLang
        load EAGLE-3 drafts from. The decoder layer is Llama-shaped; our layer adds the attention output to
        the un-normed fused feature, i.e. `norm_before_residual` false (written out: readers differ on the
        default)."""
        if self.variant != "eagle3":
            raise SpecdraftError(f"only EAGLE-3 heads export in the speculators format, not {self.variant} heads "
                                 "(their layer reads one target stream, a layout vLLM and SGLang do not load)")
        layer = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        }
        return {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
            "draft_vocab_size": self.draft_vocab_size, "norm_before_residual": False,
            "target_hidden_size": self.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids), "tie_word_embeddings": False,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
            },
            "specdraft": {"format": 1, "target": self.target},
        }

    @classmethod
    def from_speculators_dict(cls, raw: dict[str, Any]) -> EagleConfig:
        if raw.get("speculators_model_type") != "eagle3":
            raise SpecdraftError(f"a speculators config of type {raw.get('speculators_model_type')!r}, not eagle3")
        if raw.get("norm_before_residual", False):
            raise SpecdraftError("EAGLE-3 heads with norm_before_residual=true are not supported")
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise SpecdraftError("speculators config without a transformer_layer_config object")
        merged = {**layer, "draft_vocab_size": raw.get("draft_vocab_size"),
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": raw.get("eagle_aux_hidden_state_layer_ids")},
                  "specdraft": raw.get("specdraft", {})}
        return cls.from_hf_dict(merged)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> EagleConfig:
        try:
            ids = raw.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
            return cls(int(raw["hidden_size"]), int(raw["intermediate_size"]), int(raw["num_attention_heads"]),
                       int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
                       int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"])),
                       int(raw["vocab_size"]), int(raw.get("draft_vocab_size") or raw["vocab_size"]),
                       [int(i) for i in ids], float(raw.get("rms_norm_eps", 1e-6)),
                       float(raw.get("rope_theta", 10000.0)), raw.get("rope_scaling"),
                       int(raw.get("max_position_embeddings", 4096)), dict(raw.get("specdraft", {}).get("target", {})),
                       str(raw.get("specdraft", {}).get("variant", "eagle3")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SpecdraftError(f"not an EAGLE-3 head config (missing or bad {exc})") from exc


class EagleHead(nn.Module):
    """The draft head's weights and its two forwards: `step` against a KV cache (drafting) and `unroll`
    (cache-free, autograd, training-time test over whole sequences)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.eagle = config
        cfg = self.config = config.model_config()
        cfg.layer_types = ["full"]
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = Linear(len(config.aux_layer_ids) * dim, dim, bias=False)
        self.input_layernorm = RMSNorm(dim, eps, False)
        self.hidden_norm = RMSNorm(dim, eps, False)
        self.attn = Attention(cfg, 0)
        # q/k/v read the embedding and the feature side by side.
        self.attn.wqkv = Linear(2 * dim, self.attn.wqkv.out_features, bias=False)
        self.post_attention_layernorm = RMSNorm(dim, eps, False)
        self.mlp = MLP(cfg)
        self.norm = RMSNorm(dim, eps, False)
        self.lm_head = Linear(dim, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size))
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                             persistent=False)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.set_draft_vocab(torch.arange(min(config.draft_vocab_size, config.vocab_size)))

    # ------------------------------------------------------------------------------------------ weights

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary as target ids (any order; stored sorted, as EAGLE-3 does)."""
        ids = torch.sort(torch.as_tensor(target_ids, dtype=torch.long).unique()).values
        if len(ids) != self.eagle.draft_vocab_size:
            raise ValueError(f"{len(ids)} distinct draft tokens for a draft vocabulary of "
                             f"{self.eagle.draft_vocab_size}")
        self.draft_to_target.copy_(ids)
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def init_weights(self, seed: int = 0, std: float = 0.02) -> EagleHead:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    def trainable(self) -> EagleHead:
        for p in self.parameters():
            p.requires_grad_(True)
        return self

    def _apply(self, fn, recurse=True):  # keep the RoPE table fp32 (as the runtime does)
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.config.head_dim, self.config.rope_theta,
                                      self.config.rope_scaling).to(self.lm_head.weight.device)
        self._rope_table = None
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its activations (a drafter's quantized head keeps int8 / int4 linears)."""
        return self.norm.weight.dtype

    @property
    def quantized(self) -> bool:
        return not isinstance(self.lm_head, nn.Linear)

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under EAGLE-3's names (q/k/v and gate/up split), as vLLM loads them."""
        if self.quantized:
            raise SpecdraftError("this EAGLE head's linear layers were quantized for drafting; save or export "
                                 "the head as loaded from its checkpoint")
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        wq, wk, wv = self.attn.wqkv.weight.split([q, kv, kv])
        gate, up = self.mlp.w_gate_up.weight.chunk(2)
        tensors = {
            "fc.weight": self.fc.weight, "midlayer.input_layernorm.weight": self.input_layernorm.weight,
            "midlayer.hidden_norm.weight": self.hidden_norm.weight,
            "midlayer.self_attn.q_proj.weight": wq, "midlayer.self_attn.k_proj.weight": wk,
            "midlayer.self_attn.v_proj.weight": wv, "midlayer.self_attn.o_proj.weight": self.attn.wo.weight,
            "midlayer.post_attention_layernorm.weight": self.post_attention_layernorm.weight,
            "midlayer.mlp.gate_proj.weight": gate, "midlayer.mlp.up_proj.weight": up,
            "midlayer.mlp.down_proj.weight": self.mlp.w_down.weight, "norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head.weight, "d2t": self.d2t, "t2d": self.t2d,
        }
        return {k: v.detach().contiguous().clone() for k, v in tensors.items()}

    def speculators_state_dict(self) -> dict[str, torch.Tensor]:
        """The same tensors under the speculators format's names (`layers.0.*` for `midlayer.*`)."""
        return {_speculators_name(k): v for k, v in self.vllm_state_dict().items()}

    def load_vllm_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """EAGLE-3 tensors under either naming (`midlayer.*`, or the speculators format's `layers.0.*`)."""
        state = {("midlayer." + k[len(SPECULATORS_LAYER):] if k.startswith(SPECULATORS_LAYER) else k): v
                 for k, v in state.items()}
        try:
            with torch.no_grad():
                pairs = [
                    (self.fc.weight, state["fc.weight"]),
                    (self.input_layernorm.weight, state["midlayer.input_layernorm.weight"]),
                    (self.hidden_norm.weight, state["midlayer.hidden_norm.weight"]),
                    (self.attn.wqkv.weight, torch.cat([state[f"midlayer.self_attn.{p}_proj.weight"]
                                                       for p in "qkv"])),
                    (self.attn.wo.weight, state["midlayer.self_attn.o_proj.weight"]),
                    (self.post_attention_layernorm.weight, state["midlayer.post_attention_layernorm.weight"]),
                    (self.mlp.w_gate_up.weight, torch.cat([state["midlayer.mlp.gate_proj.weight"],
                                                           state["midlayer.mlp.up_proj.weight"]])),
                    (self.mlp.w_down.weight, state["midlayer.mlp.down_proj.weight"]),
                    (self.norm.weight, state["norm.weight"]), (self.lm_head.weight, state["lm_head.weight"]),
                ]
                for dst, src in pairs:
                    if dst.shape != src.shape:
                        raise SpecdraftError(f"EAGLE head tensor of shape {tuple(src.shape)} where "
                                             f"{tuple(dst.shape)} was expected")
                    dst.copy_(src)
                d2t = state["d2t"].long()
                self.set_draft_vocab(torch.arange(len(d2t)) + d2t)
        except KeyError as exc:
            raise SpecdraftError(f"EAGLE head weights lack tensor {exc}") from exc

    def save(self, path: str | Path, format: str = "eagle3", verifier: str = "",
             verifier_architectures: Sequence[str] = (), speculative_tokens: int = 3) -> Path:
        """Write config.json + model.safetensors. format "eagle3": EAGLE-3's own checkpoint layout
        (`LlamaForCausalLMEagle3`, `midlayer.*`); "speculators": the speculators layout (`verifier` names
        the target as the serving engine should load it)."""
        from safetensors.torch import save_file

        if format not in HEAD_FORMATS:
            raise SpecdraftError(f"unknown EAGLE head format {format!r} (choose from {', '.join(HEAD_FORMATS)})")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if format == "speculators":
            raw = self.eagle.to_speculators_dict(verifier, verifier_architectures, speculative_tokens)
            tensors = self.speculators_state_dict()
        else:
            raw, tensors = self.eagle.to_hf_dict(), self.vllm_state_dict()
        raw["torch_dtype"] = str(self.dtype).removeprefix("torch.")
        (path / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n")
        save_file(tensors, str(path / WEIGHTS_FILE))
        return path

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype | None = None,
             device: torch.device | str = "cpu") -> EagleHead:
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise SpecdraftError(f"{path} is not an EAGLE head directory ({CONFIG_FILE} + {WEIGHTS_FILE})")
        try:
            raw = json.loads((path / CONFIG_FILE).read_text())
        except json.JSONDecodeError as exc:
            raise SpecdraftError(f"{path / CONFIG_FILE} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise SpecdraftError(f"{path / CONFIG_FILE} is not a JSON object")
        config = (EagleConfig.from_speculators_dict(raw) if "speculators_model_type" in raw
                  else EagleConfig.from_hf_dict(raw))
        head = cls(config)
        head.load_vllm_state_dict(load_file(str(path / WEIGHTS_FILE)))
        head.requires_grad_(False)
        return head.to(device=device, dtype=dtype or torch.float32).eval()

    def check_target(self, target: Transformer) -> None:
        cfg, eagle = target.config, self.eagle
        if (cfg.hidden_size, cfg.vocab_size) != (eagle.hidden_size, eagle.vocab_size):
            raise SpecdraftError(
                f"EAGLE head was made for hidden size {eagle.hidden_size} / vocab {eagle.vocab_size}, the target "
                f"has {cfg.hidden_size} / {cfg.vocab_size}")
        if any(not 0 <= layer < cfg.num_layers for layer in eagle.hidden_layers):
            raise SpecdraftError(f"EAGLE head reads target layers {eagle.aux_layer_ids} (vLLM numbering); the "
                                 f"target has {cfg.num_layers}")

    # ------------------------------------------------------------------------------------------ forwards

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., streams*dim] target streams (EAGLE-3: low, mid, high concatenated) -> [..., dim]."""
        return self.fc(aux)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [B, T, 1, head_dim] of the positions, in the head's dtype."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        sin = emb.sin()
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return emb.cos().to(self.dtype), signed_sin.to(self.dtype)

    def _rope_cached(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_rope` from tables computed once per head (drafting asks for a few positions per step)."""
        if self._rope_table is None or self._rope_table[0].dtype != self.dtype:
            span = torch.arange(self.eagle.max_position_embeddings, device=self.inv_freq.device)[None, :]
            cos, sin = self._rope(span)
            self._rope_table = (cos[0], sin[0])
        cos, sin = self._rope_table
        return cos[positions], sin[positions]

    def _inputs(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def _finish(self, attn_out: torch.Tensor, hidden: torch.Tensor, logit_rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(draft logits, the layer's output before the final norm) from the attention output. logit_rows [B]:
        the logits of only that row of each batch entry ([B, draft_vocab]); -1 for none at all (None)."""
        residual = hidden + attn_out
        out = residual + self.mlp(self.post_attention_layernorm(residual))
        if logit_rows is None:
            return self.lm_head(self.norm(out)), out
        if bool((logit_rows < 0).all()):
            return None, out
        picked = out[torch.arange(out.shape[0], device=out.device), logit_rows.clamp(min=0)]
        return self.lm_head(self.norm(picked)), out

    @torch.inference_mode()
    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: KVCache, slots: Sequence[int],
             positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
             branch_mask: torch.Tensor | None = None, logit_rows: torch.Tensor | None = None
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Score T new head positions [B, T] behind each slot's committed length (nothing is committed), as
        the runtime's `Transformer.forward` does for tokens: embeds [B, T, dim] (the target's embeddings of
        token t+1), hidden [B, T, dim] (fused target features or the head's own outputs). Returns draft
        logits [B, T, draft_vocab] (with `logit_rows`: see `_finish`) and output hidden states [B, T, dim]."""
        B, T, _ = embeds.shape
        slots = list(slots)
        cache.check_room(slots, T)
        starts = [cache.lengths[s] for s in slots]
        device = embeds.device
        if positions is None:
            positions = torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)[None, :]
        key_len = min(cache.max_len, -(-(max(starts) + T) // KEY_BLOCK) * KEY_BLOCK)
        if tree_mask is None and branch_mask is None and B == T == 1:  # one chain step: every key up to its own
            key_len, mask = starts[0] + 1, None
        elif tree_mask is None and branch_mask is None:  # a chain: each row sees the keys up to its own
            limit = torch.tensor(starts, device=device)[:, None] + torch.arange(1, T + 1, device=device)
            visible = torch.arange(key_len, device=device) < limit[..., None]        # [B, T, key_len]
            mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))[:, None, :, None]
        else:
            mask = attention_masks(self.config, starts, positions, tree_mask, key_len, branch_mask)["full"]
        hidden = hidden.to(self.dtype)
        attn_out = self._attend(self._inputs(embeds.to(self.dtype), hidden), self._rope_cached(positions), cache,
                                slots, starts, key_len, mask)
        return self._finish(attn_out, hidden, logit_rows)

    def _attend(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                slots: list[int], starts: list[int], key_len: int, mask: torch.Tensor | None) -> torch.Tensor:
        """The layer's attention over its cache (new keys written at each slot's `starts`), with the products
        in fp32 (the cache's dtype): the runtime's attention multiplies in the model's dtype, and torch's
        bf16 products on CPUs without native bf16 cost about 10 ms each whatever their size, several times a
        whole draft step. Projections stay in the head's dtype (the fused kernels' linears). Drafts need no
        bit-exactness, only the same math. mask: additive [B, 1, T, 1, key_len] (`attention_masks`), or None
        for queries that see every key read."""
        attn = self.attn
        B, T, _ = x.shape
        H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        qkv = attn.wqkv(x).view(B, T, H + 2 * Hkv, D)
        qk = apply_rope(qkv[:, :, :H + Hkv], *rope).float()
        new_values = qkv[:, :, H + Hkv:].float()
        k_cache, v_cache = cache.k[0], cache.v[0]
        for b, (slot, start) in enumerate(zip(slots, starts)):
            k_cache[slot, :, start:start + T] = qk[b, :, H:].transpose(0, 1)
            v_cache[slot, :, start:start + T] = new_values[b].transpose(0, 1)
        first = slots[0]
        if slots == list(range(first, first + B)):  # contiguous slots: views, no copy
            keys, values = k_cache[first:first + B, :, :key_len], v_cache[first:first + B, :, :key_len]
        else:
            keys, values = k_cache[slots, :, :key_len], v_cache[slots, :, :key_len]
        out = F.scaled_dot_product_attention(qk[:, :, :H].transpose(1, 2), keys, values,
                                             attn_mask=None if mask is None else mask[:, :, :, 0],
                                             scale=self.config.attn_scale, enable_gqa=True)
        return attn.wo(out.transpose(1, 2).reshape(B, T, H * D).to(x.dtype))

    def unroll(self, embeds: torch.Tensor, fused: torch.Tensor, steps: int,
               valid: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Training-time test over whole sequences, cache-free and differentiable.

        embeds [B, T + steps - 1, dim]: embeds[:, t] is the embedding of token t+1; fused [B, T, dim]: the
        fused target feature of position t. Step 0 is the head on target features (row t predicts token
        t+2); step s > 0 feeds the head's own step s-1 outputs, as drafting does: row t of step s is the head
        at position t+s after s tokens it drafted itself, and attends to step 0's rows 0..t (the verified
        context) and to row t of steps 1..s (its own earlier drafts). Returns the logits of every step
        [B, T, draft_vocab] and its output hidden states [B, T, dim] (what the next step reads; an EAGLE-1
        head learns them as the target's next features). valid [B, T] bool: real (not padding) positions of
        step 0 (default all).
        """
        B, T, _ = fused.shape
        cfg = self.config
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        G = H // Hkv
        causal = torch.ones(T, T, dtype=torch.bool, device=fused.device).tril()
        if valid is not None:
            causal = causal[None] & valid[:, None, :]
        bias0 = torch.zeros(causal.shape, dtype=torch.float32, device=fused.device).masked_fill(~causal, float("-inf"))
        bias0 = bias0[:, None] if bias0.dim() == 3 else bias0  # [B or 1, 1, T, T] after broadcasting
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        hidden = fused
        out, outs = [], []
        for s in range(steps):
            positions = (torch.arange(T, device=fused.device) + s)[None, :].expand(B, T)
            x = self._inputs(embeds[:, s:s + T], hidden)
            qkv = self.attn.wqkv(x).view(B, T, H + 2 * Hkv, D)
            qk = apply_rope(qkv[:, :, :H + Hkv], *self._rope(positions))
            q = qk[:, :, :H].transpose(1, 2)                                   # [B, H, T, D]
            k = qk[:, :, H:].transpose(1, 2).repeat_interleave(G, dim=1)      # [B, H, T, D]
            v = qkv[:, :, H + Hkv:].transpose(1, 2).repeat_interleave(G, dim=1)
            keys.append(k)
            values.append(v)
            scale = cfg.attn_scale
            scores = [(q @ keys[0].transpose(-1, -2)).float() * scale + bias0]
            scores += [((q * keys[j]).sum(-1, keepdim=True)).float() * scale for j in range(1, s + 1)]
            probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1).to(q.dtype)
            attn = probs[..., :T] @ values[0]
            for j in range(1, s + 1):
                attn = attn + probs[..., T + j - 1:T + j] * values[j]
            attn_out = self.attn.wo(attn.transpose(1, 2).reshape(B, T, H * D))
            logits, hidden = self._finish(attn_out, hidden)
            out.append(logits)
            outs.append(hidden)
        return out, outs


HEAD_FORMATS = ("eagle3", "speculators")
SPECULATORS_LAYER = "layers.0."


def _speculators_name(name: str) -> str:
    return SPECULATORS_LAYER + name[len("midlayer."):] if name.startswith("midlayer.") else name


def aux_features(hidden: dict[int, torch.Tensor], layers: Sequence[int], rows: Sequence[int] | None = None
                 ) -> torch.Tensor:
    """The target streams of the given rows, concatenated in fc's order: [rows, streams*dim]."""
    parts = [hidden[layer] if rows is None else hidden[layer][list(rows)] for layer in layers]
    return torch.cat(parts, dim=-1).clone()


@dataclass
class _EagleState:
    slot: int
    params: SamplingParams
    generator: torch.Generator | None
    pending: list[torch.Tensor]  # aux features [m, 3*dim] of positions known but not yet fed to the head
    known: int  # positions whose target features are known (fed + pending)


HEAD_WEIGHTS = {"float": 0, "int8": 8, "int4": 4}  # the drafter option -> bits of the quantized linears


def check_head_weights(target: Transformer, weights: str) -> None:
    """What a drafter keeps the head's linear layers in: `float` (the target's dtype, as trained), or int8 /
    int4 (torch's weight-only CPU kernels). A draft step reads the whole head from memory (SmolLM2's: 20 MB
    in bf16), so fewer bytes make a cheaper step, but the drafts change a little. Measured on Sapphire Rapids
    (stop 41, `scripts/ab_eagle_weights.py`), dev suite: one chain step costs 0.111 / 0.099 / 0.080 of a
    bf16 target step for about the same tokens per forward (1.46 / 1.46 / 1.45); trees of 8 at a fixed
    depth accept a little less (1.73 / 1.70 / 1.68), and end to end (adaptive trees) the three are within
    this VM's noise of each other (1.076x / 1.071x / 1.086x plain in one run, 1.074x / 1.045x / 1.065x in
    another). With nothing measurable to gain, drafts stay as trained by default. Verification keeps the
    output the target's whatever the head's weights."""
    from specdraft.runtime.quant import quant_supported

    if not isinstance(weights, str) or weights not in HEAD_WEIGHTS:
        raise SpecdraftError(f"EAGLE head weights {weights!r}: choose from {', '.join(HEAD_WEIGHTS)}")
    bits = HEAD_WEIGHTS[weights]
    if bits and not (target.device.type == "cpu" and quant_supported(bits)):
        raise SpecdraftError(f"EAGLE head weights {weights!r} need torch's {weights} weight-only CPU kernel "
                             "and a target on CPU; use weights float")


class EagleDrafter:
    """Drafts with an EAGLE-3 head on the target's features (see the module docstring). The head is moved
    to the target's device and dtype in place, and its linear layers quantized in place for `weights` int8 /
    int4 (`check_head_weights`)."""

    def __init__(self, head: EagleHead, target: Transformer, name: str = "eagle", max_len: int = 4096,
                 max_batch: int = 1, weights: str = "float") -> None:
        from specdraft.runtime.quant import quantize_linears

        head.check_target(target)
        check_head_weights(target, weights)
        self.head = head.to(device=target.device, dtype=target.dtype).eval()
        self.head.requires_grad_(False)
        if HEAD_WEIGHTS[weights]:
            # group 64 divides the hidden sizes of the models here (576, 640); int8 ignores it
            quantize_linears(self.head, HEAD_WEIGHTS[weights], group_size=64)
        self.weights = weights
        self.target = target
        self.name = name
        self.layers = head.eagle.hidden_layers
        self.hidden_layers = tuple(sorted(set(self.layers)))
        max_len = min(max_len, target.config.max_position_embeddings)
        # Room behind the context for a chain or a tree (TREE_BEAM nodes per level but the last).
        cfg = head.config
        room = TREE_BEAM * MAX_DRAFT_DEPTH + 1
        self.cache = KVCache(1, cfg.num_kv_heads, cfg.head_dim, max_len + room, max_batch, torch.float32,
                             target.device)
        self.max_len = max_len
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._states: dict[int, _EagleState] = {}

    # ------------------------------------------------------------------------------------------ requests

    def add_request(self, request: DraftRequest) -> None:
        if not self._free_slots:
            raise SpecdraftError(f"drafter {self.name!r} serves {self.cache.num_slots} requests at once")
        missing = [layer for layer in self.hidden_layers if layer not in request.prompt_hidden]
        if missing:
            raise SpecdraftError(f"the engine did not pass target layers {missing} to {self.name!r}")
        aux = aux_features(request.prompt_hidden, self.layers)
        state = _EagleState(self._free_slots.pop(), request.params, request.generator, [aux], aux.shape[0])
        self.cache.reset(state.slot)
        self._states[request.request_id] = state
        # The prompt's positions but the last go into the head now (their tokens are all in the prompt): a
        # per-request cost like the target's prefill, kept out of the first round's drafting time, which the
        # engine's controller reads as the cost of drafting.
        if len(request.prompt_ids) >= 2:
            self._feed([state], [list(request.prompt_ids[1:])], with_logits=False)

    def remove_request(self, request_id: int) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.cache.reset(state.slot)
            self._free_slots.append(state.slot)

    def observe(self, request_id: int, verified: Verified) -> None:
        state = self._states[request_id]
        if not verified.hidden:
            raise SpecdraftError(f"{self.name!r} needs the target's hidden states in every verified round")
        rows = [0] + [1 + i for i in verified.accepted]
        state.pending.append(aux_features(verified.hidden, self.layers, rows))
        state.known += len(rows)

    # ------------------------------------------------------------------------------------------ drafting

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(tokens.to(self.target.device))

    def _catch_up(self, states: list[_EagleState], contexts: Sequence[Sequence[int]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every request's unseen target-feature positions and commit them. Returns, per request, the
        draft logits [B, draft_vocab] and output hidden state [B, dim] of its last position (n-2), which
        predict c_n."""
        feeds = [[int(t) for t in context[self.cache.length(state.slot) + 1:state.known + 1]]
                 for state, context in zip(states, contexts)]
        return self._feed(states, feeds)

    def _feed(self, states: list[_EagleState], feeds: list[list[int]], with_logits: bool = True
              ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One head forward over each request's next positions (feeds[b]: the tokens t+1 paired with its
        oldest pending features, right-padded: a pad's keys land past its row's committed length and stay
        masked); commits them and drops the features used. Returns the last fed position's draft logits
        (None without `with_logits`) and output hidden state."""
        head = self.head
        width = max(len(f) for f in feeds)
        dim = head.config.hidden_size
        tokens = torch.zeros(len(states), width, dtype=torch.long)
        hidden = torch.zeros(len(states), width, dim, dtype=head.dtype, device=self.target.device)
        with torch.inference_mode():
            for b, (state, feed) in enumerate(zip(states, feeds)):
                feat = torch.cat(state.pending)
                tokens[b, :len(feed)] = torch.tensor(feed, dtype=torch.long)
                hidden[b, :len(feed)] = head.fuse(feat[:len(feed)].to(head.dtype))
                state.pending = [feat[len(feed):]] if len(feed) < len(feat) else []
        last = torch.tensor([len(f) - 1 for f in feeds])
        logits, out = head.step(self._embed(tokens), hidden, self.cache, [s.slot for s in states],
                                logit_rows=last if with_logits else torch.full_like(last, -1))
        for state, feed in zip(states, feeds):
            self.cache.commit(state.slot, self.cache.length(state.slot) + len(feed))
        return logits, out[torch.arange(len(states)), last]

    def _ready(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]], max_ks: Sequence[int]
               ) -> list[int]:
        rows = []
        for i, (rid, context, k) in enumerate(zip(request_ids, contexts, max_ks)):
            state = self._states[rid]
            if k <= 0 or len(context) + 1 > self.max_len:
                continue
            if state.known != len(context) - 1 or self.cache.length(state.slot) >= state.known:
                raise SpecdraftError(f"{self.name!r}: target features known for {state.known} tokens of a "
                                     f"{len(context)}-token context (every round must be observed)")
            rows.append(i)
        return rows

    def propose(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]], max_ks: Sequence[int],
                max_nodes: Sequence[int] | None = None) -> list[Proposal]:
        nodes = list(max_nodes) if max_nodes is not None else list(max_ks)
        out: list[Proposal] = [Proposal([]) for _ in request_ids]
        ready = self._ready(request_ids, contexts, max_ks)
        if not ready:
            return out
        states = [self._states[request_ids[i]] for i in ready]
        logits, hidden = self._catch_up(states, [contexts[i] for i in ready])
        bases = [self.cache.length(s.slot) for s in states]
        room = self.cache.max_len - max(bases)
        ks = [max(1, min(max_ks[i], self.max_len - len(contexts[i]))) for i in ready]
        tree_rows = [j for j, i in enumerate(ready) if nodes[i] > max_ks[i] and room > TREE_BEAM * ks[j]]
        chain_rows = [j for j in range(len(ready)) if j not in tree_rows]
        if chain_rows:
            chains = self._chains([states[j] for j in chain_rows], logits[chain_rows], hidden[chain_rows],
                                  [ks[j] for j in chain_rows])
            for j, proposal in zip(chain_rows, chains):
                out[ready[j]] = proposal
        if tree_rows:
            trees = self._trees([states[j] for j in tree_rows], logits[tree_rows], hidden[tree_rows],
                                [ks[j] for j in tree_rows], [nodes[ready[j]] for j in tree_rows])
            for j, proposal in zip(tree_rows, trees):
                out[ready[j]] = proposal
        for state, base in zip(states, bases):
            self.cache.commit(state.slot, base)  # drop every draft position: verified ones get target features
        return out

    def _pick(self, states: list[_EagleState], logits: torch.Tensor) -> tuple[list[int], list[torch.Tensor | None]]:
        """Per row of draft-vocabulary `logits`: (target token id, its draft distribution over the target
        vocabulary, or None when greedy)."""
        head = self.head
        if all(s.params.greedy for s in states) and cpu_kernels.reduces(logits):
            # the kernels' one-call argmax: torch's reduction ops cost about 0.07 ms a pick here, 5-7% of a step
            return head.draft_to_target[cpu_kernels.argmax_rows(logits)].tolist(), [None] * len(states)
        draft_ids, dists = sample_rows(logits, [s.params for s in states], [s.generator for s in states])
        fulls: list[torch.Tensor | None] = []
        for probs in dists:
            full = None
            if probs is not None:
                full = torch.zeros(head.eagle.vocab_size, dtype=torch.float32, device=probs.device)
                full[head.draft_to_target] = probs
            fulls.append(full)
        return head.draft_to_target[draft_ids].tolist(), fulls

    def _chains(self, states: list[_EagleState], logits: torch.Tensor, hidden: torch.Tensor,
                ks: list[int]) -> list[Proposal]:
        tokens: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        active = list(range(len(states)))
        while True:
            picked, dists = self._pick([states[b] for b in active], logits)
            for b, token, dist in zip(active, picked, dists, strict=True):
                tokens[b].append(token)
                if dist is not None:
                    probs[b].append(dist)
            active_next = [b for b in active if len(tokens[b]) < ks[b]]
            if not active_next:
                break
            keep = [active.index(b) for b in active_next]
            embeds = self._embed(torch.tensor([[tokens[b][-1]] for b in active_next]))
            slots = [states[b].slot for b in active_next]
            step_logits, step_hidden = self.head.step(embeds, hidden[keep][:, None], self.cache, slots)
            for b in active_next:
                self.cache.commit(states[b].slot, self.cache.length(states[b].slot) + 1)
            logits, hidden, active = step_logits[:, 0], step_hidden[:, 0], active_next
        return [Proposal(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _trees(self, states: list[_EagleState], first_logits: torch.Tensor, first_hidden: torch.Tensor,
               ks: list[int], max_nodes: list[int]) -> list[Proposal]:
        """EAGLE-2-style top-k trees, as draft_model.py grows them; a node is fed with its token and the
        head's output at its parent (the row whose logits proposed it)."""
        bases = [self.cache.length(s.slot) for s in states]
        logits = {b: first_logits[b:b + 1] for b in range(len(states))}
        hiddens = {b: first_hidden[b:b + 1] for b in range(len(states))}  # rows of `frontier`
        candidates: list[list[TreeNode]] = [[] for _ in states]
        source: list[list[torch.Tensor]] = [[] for _ in states]  # per candidate: the hidden state that proposed it
        fed: list[list[int]] = [[] for _ in states]
        frontier = [[ROOT] for _ in states]
        to_target = self.head.draft_to_target.tolist()
        for level in range(1, max(ks) + 1):
            for b in range(len(states)):
                if level > ks[b]:
                    continue
                log_probs = torch.log_softmax(logits[b].float(), -1)
                for row, parent in enumerate(frontier[b]):
                    added = add_children(candidates[b], parent, log_probs[row], level, max_nodes[b],
                                         to_target.__getitem__)
                    source[b].extend([hiddens[b][row]] * added)
            growing = [b for b in range(len(states)) if level < ks[b]]
            if not growing:
                break
            for b in growing:
                frontier[b] = next_frontier(candidates[b], level)
            block = level_block([candidates[b] for b in growing], [frontier[b] for b in growing],
                                [fed[b] for b in growing], [bases[b] for b in growing])
            hidden = torch.zeros(*block.tokens.shape, first_hidden.shape[-1], dtype=first_hidden.dtype,
                                 device=first_hidden.device)
            for g, b in enumerate(growing):
                for row, c in enumerate(frontier[b]):
                    hidden[g, row] = source[b][c]
            step_logits, step_hidden = self.head.step(
                self._embed(block.tokens), hidden, self.cache, [states[b].slot for b in growing],
                positions=block.positions, tree_mask=block.tree_mask, branch_mask=block.branch_mask)
            logits, hiddens = {}, {}
            for g, b in enumerate(growing):
                n = len(frontier[b])
                self.cache.commit(states[b].slot, self.cache.length(states[b].slot) + n)
                fed[b].extend(frontier[b])
                logits[b], hiddens[b] = step_logits[g, :n], step_hidden[g, :n]
        return [best_tree(c, n) for c, n in zip(candidates, max_nodes)]


def make_eagle_drafter(path: str, target: Transformer, max_len: int = 4096, max_batch: int = 1,
                       name: str | None = None, weights: str = "float") -> EagleDrafter:
    head = EagleHead.load(path, dtype=target.dtype, device=target.device)
    return EagleDrafter(head, target, name=name or f"eagle:{path}", max_len=max_len, max_batch=max_batch,
                        weights=weights)


__all__ = ["HEAD_WEIGHTS", "EagleConfig", "EagleDrafter", "EagleHead", "aux_features", "default_aux_layer_ids",
           "check_head_weights", "make_eagle_drafter"]

