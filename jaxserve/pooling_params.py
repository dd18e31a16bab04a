"""PoolingParams: how one request's hidden states become its embedding (vLLM's names).

An engine started with `runner="pooling"` runs a decoder checkpoint as an embedding model, as
vLLM converts a `*ForCausalLM` (Qwen3-Embedding and its kin): the final-normed hidden state of
the prompt's last token, L2-normalised unless `normalize=False`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.sampling_params import _check_bool, _check_int

# vLLM's pooling tasks; jaxserve's pooling engines do "embed" (last-token pooling).
POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")


@dataclass
class PoolingParams:
    truncate_prompt_tokens: int | None = None  # keep the prompt's last n tokens (-1: max_model_len)
    dimensions: int | None = None  # matryoshka: the leading entries of the embedding
    normalize: bool | None = None  # L2-normalise the embedding (default: yes)
    use_activation: bool | None = None  # classification's activation (classify, score)
    task: str | None = None  # set by the LLM method that takes the params (embed, encode, ...)

    def __post_init__(self) -> None:
        _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, allow_none=True,
                   low=-1)
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be >= 1 or -1, got 0")
        if self.normalize is not None:
            _check_bool("normalize", self.normalize)
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")

    def verify(self, task: str) -> None:
        """The params as `task` takes them: a ValueError naming a field it cannot honour."""
        if task != "embed":
            raise ValueError(f"pooling task {task!r} is not supported: jaxserve's pooling "
                             "engines embed (last-token pooling of a decoder checkpoint)")
        if self.task is not None and self.task != task:
            raise ValueError(f"task: these params are for {self.task!r}, not {task!r}")
        if self.use_activation is not None:
            raise ValueError("use_activation: the embed task takes only dimensions and "
                             "normalize")
        if self.dimensions is not None:
            raise ValueError("dimensions: this model does not support matryoshka "
                             "representation; changing the output dimensions would give poor "
                             "embeddings")
        self.task = task

    def pool(self, hidden: np.ndarray) -> np.ndarray:
        """The embedding of a request from its last token's final hidden state, f32[D]."""
        out = hidden.astype(np.float32)
        if self.normalize is not False:
            out = out / max(float(np.linalg.norm(out)), 1e-12)
        return out
