"""Whether a request stops at the token it just got: length caps, EOS, stop token ids, grammar.

Stop strings are checked on detokenized text by the output processor, not here.
"""

from __future__ import annotations

from collections.abc import Set

from jaxserve.core.request import Request, RequestStatus


def stop_status(request: Request, token: int, num_output_tokens: int, max_model_len: int,
                eos_token_ids: Set[int]) -> RequestStatus | None:
    """The finished status `token`, the request's output token number `num_output_tokens`
    (counted from 1), gives `request`; None: it goes on."""
    params = request.sampling_params
    if (request.num_prompt_tokens + num_output_tokens >= max_model_len
            or num_output_tokens >= request.max_tokens):
        return RequestStatus.FINISHED_LENGTH_CAPPED
    if num_output_tokens < params.min_tokens:
        return None
    if token in eos_token_ids and not params.ignore_eos:
        return RequestStatus.FINISHED_STOPPED
    if params.stop_token_ids and token in params.stop_token_ids:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    return None


def grammar_status(request: Request, token: int) -> RequestStatus | None:
    """Feed a sampled token to the request's matcher: stopped once the grammar is complete
    (nothing but EOS could follow), failed if the matcher refuses it (the mask forbids that
    unless every token was masked, e.g. EOS held back by min_tokens)."""
    so = request.structured_output
    if not so.accept(token):
        return RequestStatus.FINISHED_ERROR
    return RequestStatus.FINISHED_STOPPED if so.is_terminated else None
