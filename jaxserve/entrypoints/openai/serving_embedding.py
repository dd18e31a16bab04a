"""`POST /v1/embeddings`: a pooling engine's (runner="pooling") embeddings of one or more
inputs, as floats or base64."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import uuid
from typing import Any

import numpy as np

from jaxserve.entrypoints.openai.errors import APIError, bad_request
from jaxserve.entrypoints.openai.protocol import (EmbeddingChatRequest, EmbeddingData,
                                                  EmbeddingRequest, EmbeddingResponse)
from jaxserve.entrypoints.openai.serving_common import OpenAIServing, usage
from jaxserve.outputs import PoolingRequestOutput
from jaxserve.pooling_params import PoolingParams

_POOLING_FIELDS = ("input", "truncate_prompt_tokens", "normalize", "dimensions", "priority")


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, req: EmbeddingRequest | EmbeddingChatRequest) -> EmbeddingResponse:
        self.check_request(req)
        if not self.llm.engine.pooling:
            raise APIError(400, "input: this server's model generates text; embeddings need "
                           "a server started with --runner pooling", "input", "unsupported")
        try:
            params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens,
                                   normalize=req.normalize)
        except ValueError as exc:
            raise bad_request(exc, fields=_POOLING_FIELDS) from None
        prompts = await asyncio.to_thread(self._prompts, req)
        request_id = f"embd-{req.request_id or uuid.uuid4().hex}"
        outs = await asyncio.gather(*(self._embed(p, params, f"{request_id}-{i}", req.priority)
                                      for i, p in enumerate(prompts)), return_exceptions=True)
        for out in outs:
            if isinstance(out, ValueError):  # the engine names the ids it was given
                param = "input" if str(out).startswith("prompt_token_ids") else None
                raise bad_request(out, param, fields=_POOLING_FIELDS) from None
            if isinstance(out, BaseException):
                raise out
        num_tokens = sum(len(out.prompt_token_ids) for out in outs)
        return EmbeddingResponse(
            id=request_id, model=req.model or self.model_names[0],
            data=[EmbeddingData(index=i, embedding=_encoded(out.outputs.data,
                                                            req.encoding_format))
                  for i, out in enumerate(outs)],
            usage=usage(num_tokens, 0))

    def _prompts(self, req: EmbeddingRequest | EmbeddingChatRequest) -> list[dict[str, Any]]:
        if isinstance(req, EmbeddingChatRequest):
            return [{"prompt_token_ids": self.fit(self.render_chat(req), req, "messages", None)}]
        return self.tokenized_prompts(req.input, "input", req.add_special_tokens,
                                      lambda ids: self.fit(ids, req, "input", None))

    async def _embed(self, prompt: dict[str, Any], params: PoolingParams, request_id: str,
                     priority: int) -> PoolingRequestOutput:
        async with contextlib.aclosing(self.llm.encode(prompt, params, request_id,
                                                       priority=priority)) as outputs:
            async for out in outputs:
                return out
        raise RuntimeError(f"request {request_id} ended without an output")


def _encoded(data: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the float32 values' little-endian bytes
        return base64.b64encode(data.astype("<f4").tobytes()).decode("ascii")
    return data.tolist()
