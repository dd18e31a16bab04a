"""One process of a multi-host run (started by test_multihost.py): joins jax.distributed, runs
the engine on the global mesh, and (process 0) writes the generated tokens as JSON."""

from __future__ import annotations

import json
import sys


def main() -> None:
    model, port, num_processes, process_id, tp, out_path, prompts_json = sys.argv[1:8]
    from jaxserve import LLM, SamplingParams

    kwargs = dict(max_model_len=128, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                  token_buckets=[16, 64], request_buckets=[8], compilation_cache_dir="",
                  tensor_parallel_size=int(tp))
    if int(num_processes) > 1:
        kwargs |= dict(coordinator_address=f"127.0.0.1:{port}",
                       num_processes=int(num_processes), process_id=int(process_id),
                       distributed_timeout_s=60)
    llm = LLM(model, **kwargs)
    prompts = json.loads(prompts_json)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    if int(process_id) == 0:
        with open(out_path, "w") as f:
            json.dump([o.outputs[0].token_ids for o in outs], f)


if __name__ == "__main__":
    main()
