"""`LLM.beam_search`, as vLLM's: each step asks the engine for one token of every live beam
with its top 2 x beam_width logprobs, and keeps the beam_width best extensions; a beam that
ends in EOS is set aside as complete. Scores are cumulative logprob / length ** length_penalty
(the length counts the prompt and not a final EOS, as vLLM's)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from jaxserve.outputs import Logprob, RequestOutput
from jaxserve.sampling_params import BeamSearchParams, SamplingParams


@dataclass(slots=True)
class BeamSearchSequence:
    tokens: list[int]  # the prompt's and the generated ones
    logprobs: list[dict[int, Logprob]]  # per generated token
    cum_logprob: float = 0.0
    text: str | None = None  # the whole sequence decoded, once the search ends
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass(slots=True)
class _Instance:
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def beam_score(beam: BeamSearchSequence, eos_token_ids: frozenset[int],
               length_penalty: float) -> float:
    length = len(beam.tokens) - (1 if beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (length ** length_penalty)


def beam_search(generate: Callable[[list[dict], SamplingParams], list[RequestOutput]],
                prompts: Sequence[list[int]], params: BeamSearchParams,
                eos_token_ids: frozenset[int], decode: Callable[[list[int]], str] | None,
                ) -> list[BeamSearchOutput]:
    """`generate(token prompts, params)` is LLM.generate; `decode` (None: no tokenizer) gives
    each final sequence its text."""
    step = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1,
                          temperature=params.temperature, ignore_eos=True)
    instances = [_Instance([BeamSearchSequence(list(p), [])]) for p in prompts]

    def key(beam: BeamSearchSequence) -> float:
        return beam_score(beam, eos_token_ids, params.length_penalty)

    for _ in range(params.max_tokens):
        live = [(inst, beam) for inst in instances for beam in inst.beams]
        if not live:
            break
        outputs = generate([{"prompt_token_ids": beam.tokens} for _, beam in live], step)
        grown: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in instances}
        for (inst, beam), out in zip(live, outputs):
            entry = out.outputs[0].logprobs[0]
            for token_id, lp in entry.items():
                new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [entry],
                                         beam.cum_logprob + lp.logprob)
                if token_id in eos_token_ids and not params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token_id
                    inst.completed.append(new)
                else:
                    grown[id(inst)].append(new)
        for inst in instances:
            inst.beams = sorted(grown[id(inst)], key=key, reverse=True)[:params.beam_width]
    results = []
    for inst in instances:
        for beam in inst.beams:
            beam.finish_reason = "length"
        best = sorted(inst.completed + inst.beams, key=key, reverse=True)[:params.beam_width]
        for beam in best:
            beam.text = None if decode is None else decode(beam.tokens)
        results.append(BeamSearchOutput(best))
    return results
