"""EAGLE-style drafter: one decoder layer that predicts the target's next hidden state.

At position i it reads the target's last-layer hidden state h_i (after the final norm) fused
with the embedding of the token x_{i+1} that follows it, and predicts h_{i+1}; the target's LM
head turns that into a distribution over x_{i+2}. Embedding and LM head are the target's, shared
and frozen, so only `fc` and `layers.0` are trained, checkpointed and exported:

    drafter = Drafter.for_target(policy)
    h_next = drafter(hidden, next_tokens, positions)           # [B, T, H]
    logits = drafter.logits(h_next)                           # target's LM head

Positions are those of h_i (the token ids are the shifted sequence), as in vLLM's EAGLE models.
"""

from __future__ import annotations

from torch import Tensor, nn
import torch

from .linear import Linear
from .transformer import DecoderLayer, KVCache, ModelConfig, Transformer, init_weights, rope_tables, step_layout


class Drafter(nn.Module):
    def __init__(self, cfg: ModelConfig, target: Transformer | None = None):
        super().__init__()
        self.config = cfg
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)  # [emb(x_{i+1}); h_i] -> H
        self.layers = nn.ModuleList([DecoderLayer(cfg, input_norm=False)])
        # shared, frozen target parts; kept out of state_dict so checkpoints hold only our weights
        self._target: tuple[Transformer, ...] = (target,) if target is not None else ()
        # [V] token frequencies of the drafter's training data (zeros: unknown). Not a weight and not
        # exported, but in state_dict, so it travels with the drafter to every worker and checkpoint:
        # the reduced draft vocabulary (spec.draft_vocab) and spot training's vocabulary come from it
        self.register_buffer("token_counts", torch.zeros(cfg.vocab_size), persistent=True)

    @classmethod
    def for_target(cls, target: Transformer, seed: int = 0) -> "Drafter":
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        drafter = cls(target.config, target)
        init_weights(drafter)
        torch.random.set_rng_state(gen_state)
        return drafter.to(device=target.device, dtype=target.dtype)

    @property
    def target(self) -> Transformer:
        if not self._target:
            raise RuntimeError("drafter has no target: build it with Drafter(cfg, target) or for_target()")
        return self._target[0]

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        # weights exported before token counts existed, or from another EAGLE trainer: counts unknown
        if "token_counts" not in state:
            state = {**state, "token_counts": torch.zeros(self.token_counts.shape)}
        return super().load_state_dict(state, strict=strict, assign=assign)

    @property
    def weights(self) -> dict[str, Tensor]:
        """The trainable weights only (fc.*, layers.0.*): what is averaged, exported and served."""
        return {k: v for k, v in self.state_dict().items() if k != "token_counts"}

    def new_cache(self, batch: int, max_len: int, differentiable: bool = False) -> KVCache:
        c = self.config
        p = self.fc.weight
        return KVCache(1, batch, max_len, c.num_key_value_heads, c.head_dim, p.dtype, p.device, differentiable)

    def forward(self, hidden: Tensor, next_tokens: Tensor, positions: Tensor | None = None,
                cache: KVCache | None = None, write_pos: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        """hidden: [B, T, H] target states h_i; next_tokens: [B, T] ids x_{i+1}; returns [B, T, H] ~ h_{i+1}."""
        positions, write_pos, mask = step_layout(next_tokens, positions, cache, write_pos, mask)
        with torch.no_grad():
            emb = self.target.model.embed_tokens(next_tokens)
        x = self.fc(torch.cat([emb.to(hidden.dtype), hidden], dim=-1))
        return self.layers[0](x, rope_tables(self.config, positions, x.dtype), 0, cache, write_pos, mask)

    def logits(self, h: Tensor) -> Tensor:
        # the drafter's output goes straight to the target's LM head, no extra norm (vLLM EAGLE layout)
        return self.target.lm_head(h)
