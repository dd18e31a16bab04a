"""`jaxserve run-batch`: OpenAI's batch-file format, each line answered as the server answers
it (generated text equal to the offline engine's), bad lines recorded, order kept."""

from __future__ import annotations

import json
from typing import Any

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.entrypoints.cli.main import main

MESSAGES = [{"role": "user", "content": "Hello robot"}]


def _line(custom_id: Any, url: str, body: Any, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


@pytest.fixture(scope="module")
def results(engine_args: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> list:
    folder = tmp_path_factory.mktemp("run_batch")
    lines = [
        _line("c1", "/v1/completions", {"model": "tiny", "prompt": "Once upon a time",
                                        "max_tokens": 5, "temperature": 0, "ignore_eos": True}),
        _line("chat", "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES,
                                               "max_tokens": 4, "temperature": 0}),
        _line("beam", "/v1/completions", {"prompt": "x", "use_beam_search": True}),
        "{not json",
        "",
        _line("get", "/v1/completions", {"prompt": "x"}, method="GET"),
        _line("url", "/v1/embeddings", {"input": "x"}),
        _line("stream", "/v1/completions", {"prompt": "x", "stream": True}),
        _line("other-model", "/v1/completions", {"model": "nope", "prompt": "x"}),
    ]
    (folder / "in.jsonl").write_text("\n".join(lines) + "\n")
    flags = [f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, list) else v}"
             for k, v in engine_args.items()]
    assert main(["run-batch", "-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl"),
                 "--served-model-name", "tiny", *flags]) == 0
    return [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]


def test_each_line_is_answered_in_order_with_the_servers_bodies(results, engine_args):
    assert [r["custom_id"] for r in results] == [
        "c1", "chat", "beam", None, "get", "url", "stream", "other-model"]
    assert len({r["id"] for r in results}) == len(results)
    c1, chat = results[0], results[1]
    assert (c1["response"]["status_code"], c1["error"]) == (200, None)
    llm = LLM(**engine_args)
    want = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5,
                                                           ignore_eos=True), use_tqdm=False)
    assert c1["response"]["body"]["choices"][0]["text"] == want[0].outputs[0].text
    assert c1["response"]["body"]["object"] == "text_completion"
    want_chat = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    body = chat["response"]["body"]
    assert body["choices"][0]["message"]["content"] == want_chat[0].outputs[0].text


def test_refused_and_malformed_lines_carry_an_error_naming_what_is_wrong(results):
    by_id = {r["custom_id"]: r for r in results}
    beam = by_id["beam"]
    assert beam["response"]["status_code"] == 400
    assert beam["error"]["param"] == "use_beam_search"
    assert by_id["other-model"]["response"]["status_code"] == 404
    for custom_id, words in [(None, "not JSON"), ("get", "method must be POST"),
                             ("url", "url must be one of"), ("stream", "body.stream")]:
        line = by_id[custom_id]
        assert line["response"] is None and words in line["error"]["message"], custom_id
