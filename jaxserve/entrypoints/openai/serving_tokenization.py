"""`POST /tokenize` and `/detokenize` (vLLM's extensions): the served model's tokenizer."""

from __future__ import annotations

import asyncio

from jaxserve.entrypoints.openai.errors import APIError
from jaxserve.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse,
                                                  TokenizeChatRequest, TokenizeCompletionRequest,
                                                  TokenizeResponse)
from jaxserve.entrypoints.openai.serving_common import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest,
                       ) -> TokenizeResponse:
        self.check_request(req)
        return await asyncio.to_thread(self._tokenize, req)

    def _tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest,
                  ) -> TokenizeResponse:
        if isinstance(req, TokenizeChatRequest):
            ids = self.render_chat(req, req.tools)
        else:
            if self.tokenizer is None:
                raise APIError(400, "prompt: this model has no tokenizer", "prompt")
            ids = self.encode(req.prompt, "prompt", req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=[self.token_text(t) for t in ids]
                                if req.return_token_strs else None)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_request(req)
        return await asyncio.to_thread(self._detokenize, req)

    def _detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        if self.tokenizer is None:
            raise APIError(400, "tokens: this model has no tokenizer", "tokens")
        vocab = self.llm.engine.input_processor.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary "
                           f"[0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))
