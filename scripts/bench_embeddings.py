"""Embeddings/s of jaxserve's pooling runner against HF transformers at its best, same weights,
same prompts: what a user would otherwise run is the base model (`AutoModel`) over padded
batches, taking the last token's final hidden state (left padding, so it is the last column),
normalised. HF gets each batch size of `--hf-batch-sizes` and whichever torch thread count (1
or 2) a probe finds faster; jaxserve precompiles. The embeddings are compared too.

    python scripts/bench_embeddings.py [--requests 64] [--prompt-len 32,384]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from bench_common import (dummy_hf_checkpoint, fastest_torch_threads, make_workload,
                          markdown_table, write_result)

ENGINE_ARGS = dict(load_format="hf", dtype="float32", max_model_len=512, block_size=16,
                   num_kv_blocks=1024, max_num_batched_tokens=512, max_num_seqs=32,
                   token_buckets=[16, 32, 64, 128, 256, 512], request_buckets=[8, 16, 32],
                   precompile=True)


def hf_embed(model: Any, prompts: list[list[int]], batch_size: int) -> np.ndarray:
    import torch

    out = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
        out.append(torch.nn.functional.normalize(hidden, dim=-1).numpy())
    return np.concatenate(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", default="32,384", help="LOW,HIGH token lengths")
    parser.add_argument("--hf-batch-sizes", default="8,16,32")
    args = parser.parse_args()
    import transformers

    from jaxserve import LLM

    low, high = (int(x) for x in args.prompt_len.split(","))
    path = dummy_hf_checkpoint()
    hf = transformers.AutoModel.from_pretrained(str(path)).eval()
    prompts = make_workload("embed", args.requests, (low, high), (1, 1),
                            hf.config.vocab_size, seed=0).prompts
    llm = LLM(str(path), runner="pooling", **ENGINE_ARGS)
    llm.embed(make_workload("warm", 4, (low, high), (1, 1), hf.config.vocab_size,
                            seed=1).prompts, use_tqdm=False)  # not the timed prompts: no hits
    start = time.perf_counter()
    ours = np.array([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)])
    ours_s = time.perf_counter() - start
    sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    threads = fastest_torch_threads(lambda: hf_embed(hf, prompts[:sizes[0]], sizes[0]))
    rows, best = [], float("inf")
    for b in sizes:
        start = time.perf_counter()
        theirs = hf_embed(hf, prompts, b)
        seconds = time.perf_counter() - start
        best = min(best, seconds)
        rows.append([f"HF AutoModel, batch {b} ({threads} thr)", f"{len(prompts) / seconds:.1f}",
                     f"{np.abs(theirs - ours).max():.1e}"])
    rows.insert(0, ["jaxserve LLM.embed (runner=pooling)", f"{len(prompts) / ours_s:.1f}", "-"])
    tokens = sum(map(len, prompts))
    body = (f"dummy-30m (configs/models/dummy-30m, float32), {len(prompts)} prompts of "
            f"{low}-{high} tokens ({tokens} in all), last-token pooling, normalised.\n\n"
            + markdown_table(["engine", "embeddings/s", "max |difference| from jaxserve's"],
                             rows)
            + f"\n\njaxserve / HF at its best: **{best / ours_s:.2f}x**\n")
    write_result("bench_embeddings", "Embeddings: jaxserve's pooling runner against HF", body)


if __name__ == "__main__":
    main()
