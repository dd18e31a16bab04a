"""llama.cpp's side of scripts/bench_real_model.py, run by the llama-cpp-python environment's own
interpreter (stdlib, numpy and llama_cpp only; see that script for how to install it).

Drives llama.cpp's C API as llama-server's parallel slots do: every request is a sequence with
its own part of the KV cache; each `llama_decode` batch holds one token of every decoding sequence,
then prompt tokens of the sequences still prefilling (up to n_batch tokens in all), logits
only where a token is sampled; greedy sampling (argmax) on the host; a finished sequence's
cells are freed. No KV is shared between sequences (llama-server shares none between slots).

Protocol: one JSON object per line on stdin ({"prompts", "output_lens"}), one per line on
stdout ({"token_ids", "ttft_s", "seconds", "peak_rss_kb"}); an empty line ends it.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import time

import llama_cpp as L
import numpy as np


@L.llama_log_callback
def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's log (every tensor at load) would bury the benchmark's own output."""


class LlamaCpp:
    def __init__(self, path: str, n_ctx: int, n_batch: int, n_seq_max: int) -> None:
        L.llama_log_set(_quiet, ctypes.c_void_p())
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = L.llama_context_default_params()
        # n_ctx / n_seq_max cells for each sequence, in a stream of its own (llama-server's
        # default): a unified cache would have every token attend over every sequence's cells.
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_seq_max, params.kv_unified = n_seq_max, False
        params.n_threads = params.n_threads_batch = os.cpu_count()
        self.ctx = L.llama_init_from_model(self.model, params)
        self.n_batch, self.n_seq_max = n_batch, n_seq_max
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(n_batch, 0, 1)

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> dict:
        memory = L.llama_get_memory(self.ctx)
        L.llama_memory_clear(memory, True)
        n = len(prompts)
        if n > self.n_seq_max:
            raise ValueError(f"{n} requests, but n_seq_max is {self.n_seq_max}")
        done_prompt = [0] * n  # prompt tokens in the cache
        outputs: list[list[int]] = [[] for _ in range(n)]
        ttft = [0.0] * n
        start = time.perf_counter()
        while any(len(o) < m for o, m in zip(outputs, output_lens)):
            rows: list[tuple[int, int]] = []  # (request, row in the batch) sampled this step
            b = self.batch
            b.n_tokens = 0

            def add(token: int, pos: int, seq: int, logits: bool) -> None:
                i = b.n_tokens
                b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
                b.seq_id[i][0], b.logits[i] = seq, logits
                b.n_tokens += 1

            for r in range(n):  # decoding sequences: their last token
                if done_prompt[r] == len(prompts[r]) and 0 < len(outputs[r]) < output_lens[r]:
                    rows.append((r, b.n_tokens))
                    add(outputs[r][-1], len(prompts[r]) + len(outputs[r]) - 1, r, True)
            for r in range(n):  # then prompt chunks, in order, while the batch has room
                left = len(prompts[r]) - done_prompt[r]
                take = min(left, self.n_batch - b.n_tokens)
                for j in range(take):
                    pos = done_prompt[r] + j
                    last = pos == len(prompts[r]) - 1
                    if last:
                        rows.append((r, b.n_tokens))
                    add(prompts[r][pos], pos, r, last)
                done_prompt[r] += max(take, 0)
            if L.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            for r, row in rows:
                logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, row),
                                               shape=(self.n_vocab,))
                outputs[r].append(int(np.argmax(logits)))
                if len(outputs[r]) == 1:
                    ttft[r] = time.perf_counter() - start
                if len(outputs[r]) == output_lens[r]:
                    L.llama_memory_seq_rm(memory, r, -1, -1)
        return {"token_ids": outputs, "ttft_s": ttft, "seconds": time.perf_counter() - start,
                "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def main() -> None:
    path, n_ctx, n_batch, n_seq_max = sys.argv[1], *map(int, sys.argv[2:5])
    engine = LlamaCpp(path, n_ctx, n_batch, n_seq_max)
    print(json.dumps({"ready": True, "version": L.__version__}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        job = json.loads(line)
        print(json.dumps(engine.run(job["prompts"], job["output_lens"])), flush=True)


if __name__ == "__main__":
    sys.exit(main())
